//! Leasehold logic as a self-contained executable: no language runtime needed on the Function
//! App's image (the `custom` stack provides none), so it is the safest choice for command logic.
//!
//! ```text
//! examples/logic-executable/build.sh                     # → examples/logic-executable/dist/sync-record
//! scripts/package.sh --logic examples/logic-executable/dist
//! LEASEHOLD_LOGIC_COMMAND=logic/sync-record              # an app setting of the Function App
//! ```
//!
//! It shows the fencing token at work: it keeps, per record, the highest token it has written
//! with (in `$EXAMPLE_STATE_DIR`, standing in for your target system) and refuses a write with a
//! lower one, as a store that checks fencing tokens does. Exit 0: done; anything else: the
//! trigger is retried, then given up with what this wrote to stderr as the reason.

use std::path::PathBuf;
use std::process::ExitCode;

fn var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set: run me through leasehold"))
}

fn run() -> Result<String, String> {
    let scope = var("LEASEHOLD_SCOPE")?;
    let record = var("LEASEHOLD_RECORD_ID")?;
    let attempt = var("LEASEHOLD_ATTEMPT")?;
    let token: u64 = var("LEASEHOLD_FENCING_TOKEN")?
        .parse()
        .map_err(|_| "LEASEHOLD_FENCING_TOKEN is not a number (is fencing off?)".to_string())?;
    eprintln!("working on {scope}/{record} (fencing token {token}, attempt {attempt})");

    // The "target system": one file per record holding the highest token written with.
    if let Ok(dir) = std::env::var("EXAMPLE_STATE_DIR") {
        let path = PathBuf::from(dir).join(format!("{scope}.{record}.token"));
        let written: u64 = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        if token < written {
            return Err(format!(
                "refused: fencing token {token} is older than {written}, already written"
            ));
        }
        std::fs::write(&path, token.to_string()).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(format!("executable {scope} {record} {token} {attempt}"))
}

fn main() -> ExitCode {
    match run() {
        Ok(line) => {
            if let Ok(out) = std::env::var("EXAMPLE_OUTPUT") {
                use std::io::Write;
                let file = std::fs::OpenOptions::new().create(true).append(true).open(out);
                if let Err(e) = file.and_then(|mut f| writeln!(f, "{line}")) {
                    eprintln!("writing EXAMPLE_OUTPUT: {e}");
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("{why}");
            ExitCode::FAILURE
        }
    }
}
