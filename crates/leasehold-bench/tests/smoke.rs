//! The benchmark at its tiny sizes completes: `cargo test --workspace --test smoke -- --ignored`.
//!
//! It is a test target above all so that the test build makes the benchmark binary with the
//! tests' features: CI runs that binary beside the tests (`.ci/run`), where `cargo run -p
//! leasehold-bench` resolved features for the bench alone and rebuilt most dependencies (two
//! minutes of a cold run). Ignored by default: the README's test command leaves the benchmark
//! (about 5 minutes of real time beside the tests, mostly waiting on leases) to CI and to
//! `scripts/bench.sh`.

#[test]
#[ignore = "the benchmark in smoke mode: CI runs it"]
fn the_benchmark_completes_at_its_smoke_sizes() {
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("smoke.md");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold-bench"))
        .args(["--smoke", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("the benchmark starts");
    assert!(status.success(), "leasehold-bench --smoke: {status}");
    let report = std::fs::read_to_string(&out).unwrap();
    for section in [
        "## 1.",
        "## 3. Throughput",
        "## 6. Recovery",
        "## 9. History",
        "Total benchmark time",
    ] {
        assert!(
            report.contains(section),
            "{section} missing from the report:\n{report}"
        );
    }
}
