//! The Table service client against a real Azurite: tables created, listed and dropped, entities
//! written and read back a partition at a time, pages followed, errors told apart, and every
//! request counted under its op.

use leasehold_storage::table::{
    Continuation, ENTITY_ALREADY_EXISTS, Entity, TABLE_NOT_FOUND, TableClient, escape_key, odata_literal,
    unescape_key,
};
use leasehold_storage::{Op, OpCounters, StorageAccount, StoreErrorKind};
use leasehold_test_support::{Azurite, unique_name};
use serde_json::{Value, json};

/// A table name no other test uses (letters and digits only).
fn table_name() -> String {
    unique_name("runs").replace('-', "")
}

fn client() -> TableClient {
    TableClient::new(&Azurite::shared().account(), OpCounters::new()).unwrap()
}

fn entity(value: Value) -> Entity {
    value.as_object().cloned().expect("an object")
}

/// Every entity of a partition, page by page.
async fn read_all(
    client: &TableClient,
    table: &str,
    partition: &str,
    top: Option<u32>,
) -> (Vec<Entity>, usize) {
    let (mut all, mut pages, mut next): (Vec<Entity>, usize, Option<Continuation>) = (Vec::new(), 0, None);
    loop {
        let (page, continuation) = client
            .query_partition(table, partition, top, next.as_ref())
            .await
            .expect("a page");
        pages += 1;
        if let Some(top) = top {
            assert!(page.len() <= top as usize);
        }
        all.extend(page);
        match continuation {
            Some(c) => next = Some(c),
            None => return (all, pages),
        }
    }
}

#[tokio::test]
async fn tables_are_created_listed_and_deleted() {
    let client = client();
    let name = table_name();
    let other = format!("{name}x");
    assert!(client.create_table(&name).await.unwrap(), "created");
    assert!(!client.create_table(&name).await.unwrap(), "already there");
    assert!(client.create_table(&other).await.unwrap());

    let listed = client.list_tables(&name).await.unwrap();
    assert_eq!(listed, vec![name.clone(), other.clone()]);
    assert_eq!(client.list_tables(&other).await.unwrap(), vec![other.clone()]);
    assert!(client.list_tables("").await.unwrap().contains(&name));

    assert!(client.delete_table(&name).await.unwrap(), "deleted");
    assert!(!client.delete_table(&name).await.unwrap(), "already gone");
    assert_eq!(client.list_tables(&name).await.unwrap(), vec![other.clone()]);
    assert!(client.delete_table(&other).await.unwrap());

    let counts = client.counters().snapshot();
    assert_eq!(counts.get(Op::HistoryTable), 10, "{counts}");
    assert_eq!(counts.total(), 10, "{counts}");
    assert_eq!(counts.table_total(), 10);
}

#[tokio::test]
async fn entities_round_trip_in_row_key_order() {
    let client = client();
    let table = table_name();
    let record = "contact/it's #1?";
    let partition = escape_key(record);

    // First write to a missing table: told apart, then the table made and the write sent again.
    let first = entity(json!({ "PartitionKey": partition, "RowKey": "x", "Outcome": "ok" }));
    let e = client.insert_entity(&table, &first).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::NotFound, "{e}");
    assert_eq!(e.code(), Some(TABLE_NOT_FOUND), "{e}");
    assert_eq!(e.status(), Some(404));
    assert!(client.create_table(&table).await.unwrap());
    client.insert_entity(&table, &first).await.unwrap();
    let e = client.insert_entity(&table, &first).await.unwrap_err();
    assert_eq!(e.code(), Some(ENTITY_ALREADY_EXISTS), "{e}");
    assert_eq!(e.status(), Some(409));
    assert!(!e.is_transient());

    // Runs keyed by inverted timestamps, written out of order: read back newest first.
    let stamps = [
        1_700_000_000_300u64,
        1_700_000_000_100,
        1_700_000_000_900,
        1_700_000_000_500,
    ];
    for (i, at) in stamps.iter().enumerate() {
        let run = entity(json!({
            "PartitionKey": partition,
            "RowKey": format!("{:020}", u64::MAX - at),
            "StartedMs": at.to_string(),
            "StartedMs@odata.type": "Edm.Int64",
            "Attempt": i,
            "Note": "quote ' and slash / in a value",
            "Ok": true,
        }));
        client.insert_entity(&table, &run).await.unwrap();
    }
    // Another record's partition, which a partition query must not return.
    let neighbour = escape_key("contact/it's #2?");
    client
        .insert_entity(
            &table,
            &entity(json!({ "PartitionKey": neighbour, "RowKey": "1" })),
        )
        .await
        .unwrap();

    let (runs, pages) = read_all(&client, &table, &partition, None).await;
    assert_eq!(pages, 1);
    assert_eq!(runs.len(), 5, "{runs:?}");
    let keys: Vec<&str> = runs.iter().map(|r| r["RowKey"].as_str().unwrap()).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted, "in RowKey order");
    let started: Vec<&str> = runs[..4]
        .iter()
        .map(|r| r["StartedMs"].as_str().unwrap())
        .collect();
    assert_eq!(
        started,
        ["1700000000900", "1700000000500", "1700000000300", "1700000000100"],
        "newest first"
    );
    let newest = &runs[0];
    assert_eq!(newest["PartitionKey"].as_str(), Some(partition.as_str()));
    assert_eq!(
        unescape_key(newest["PartitionKey"].as_str().unwrap()).as_deref(),
        Some(record)
    );
    assert_eq!(newest["Attempt"], json!(2));
    assert_eq!(newest["Ok"], json!(true));
    assert_eq!(newest["Note"], json!("quote ' and slash / in a value"));
    assert!(runs.iter().all(|r| r["PartitionKey"] == json!(partition)));

    // A general filter: the runs after a point, across the partition.
    let filter = format!(
        "PartitionKey eq {} and RowKey lt {}",
        odata_literal(&partition),
        odata_literal(&format!("{:020}", u64::MAX - 1_700_000_000_300))
    );
    let (later, next) = client.query(&table, Some(&filter), None, None).await.unwrap();
    assert_eq!(later.len(), 2, "{later:?}");
    assert!(next.is_none());
    let (everything, _) = client.query(&table, None, None, None).await.unwrap();
    assert_eq!(everything.len(), 6);

    let counts = client.counters().snapshot();
    assert_eq!(counts.get(Op::HistoryWrite), 8, "{counts}");
    assert_eq!(counts.get(Op::HistoryRead), 3, "{counts}");
    assert_eq!(counts.get(Op::HistoryTable), 1, "{counts}");
    assert_eq!(counts.total(), 12, "{counts}");
    client.delete_table(&table).await.unwrap();
}

#[tokio::test]
async fn small_pages_follow_the_continuation() {
    let client = client();
    let table = table_name();
    client.create_table(&table).await.unwrap();
    let partition = escape_key("account/a\\b");
    for i in 0..25u32 {
        let e = entity(json!({ "PartitionKey": partition, "RowKey": format!("{i:04}"), "N": i }));
        client.insert_entity(&table, &e).await.unwrap();
    }
    let before = client.counters().snapshot();
    let (all, pages) = read_all(&client, &table, &partition, Some(10)).await;
    assert_eq!(pages, 3, "10 + 10 + 5");
    let n: Vec<u64> = all.iter().map(|e| e["N"].as_u64().unwrap()).collect();
    assert_eq!(n, (0..25).collect::<Vec<u64>>(), "every entity once, in order");
    let read = client.counters().snapshot().since(&before);
    assert_eq!(read.get(Op::HistoryRead), 3, "one request a page: {read}");
    assert_eq!(read.total(), 3);
    client.delete_table(&table).await.unwrap();
}

#[tokio::test]
async fn a_missing_table_and_bad_names_are_told_apart() {
    let client = client();
    let e = client
        .query_partition(&table_name(), "p", Some(5), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::NotFound, "{e}");
    assert_eq!(e.code(), Some(TABLE_NOT_FOUND), "{e}");
    assert_eq!(e.op(), Op::HistoryRead);
    assert!(
        e.to_string()
            .contains("history read failed with HTTP 404 (TableNotFound)"),
        "{e}"
    );

    let before = client.counters().snapshot();
    let e = client.create_table("bad-name").await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Rejected);
    let e = client
        .insert_entity(
            &table_name(),
            &entity(json!({ "PartitionKey": "a/b", "RowKey": "1" })),
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("escape_key"), "{e}");
    let e = client
        .insert_entity(&table_name(), &entity(json!({ "RowKey": "1" })))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("PartitionKey"), "{e}");
    assert_eq!(
        client.counters().snapshot().since(&before).total(),
        0,
        "refused before anything was sent"
    );
}

/// A SAS for the table service (`ss=bqt`) authorises as well as the key.
#[tokio::test]
async fn a_shared_access_signature_works_for_tables() {
    let azurite = Azurite::shared();
    let account = StorageAccount::from_connection_string(&azurite.sas_connection_string()).unwrap();
    assert_eq!(account.table_endpoint(), Some(azurite.table_uri()));
    let client = TableClient::new(&account, OpCounters::new()).unwrap();
    let table = table_name();
    assert!(client.create_table(&table).await.unwrap());
    client
        .insert_entity(
            &table,
            &entity(json!({ "PartitionKey": "p", "RowKey": "r", "V": "x" })),
        )
        .await
        .unwrap();
    let (page, _) = client.query_partition(&table, "p", None, None).await.unwrap();
    assert_eq!(page.len(), 1);
    assert!(client.delete_table(&table).await.unwrap());
}

/// The key is checked: a wrong one is refused (403), not transient, and the message names no
/// secret.
#[tokio::test]
async fn a_wrong_key_is_refused() {
    let azurite = Azurite::shared();
    let cs = format!(
        "DefaultEndpointsProtocol=http;AccountName={};AccountKey=d3Jvbmd3cm9uZ3dyb25nd3Jvbmc=;TableEndpoint={}",
        leasehold_storage::EMULATOR_ACCOUNT,
        azurite.table_uri()
    );
    let client = TableClient::new(
        &StorageAccount::from_connection_string(&cs).unwrap(),
        OpCounters::new(),
    )
    .unwrap();
    let e = client.list_tables("runs").await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Rejected, "{e}");
    assert_eq!(e.status(), Some(403), "{e}");
    assert!(!e.to_string().contains("d3Jvbmd3"), "{e}");
}

/// Past the service's own page (1,000 entities) a query without `$top` answers a continuation,
/// and following it reads the rest.
#[tokio::test]
async fn more_than_a_page_of_entities_is_read_through_the_continuation() {
    use futures::StreamExt;
    let client = client();
    let table = table_name();
    client.create_table(&table).await.unwrap();
    let written = futures::stream::iter(0..1105u32)
        .map(|i| {
            let client = &client;
            let table = &table;
            async move {
                let e = entity(json!({ "PartitionKey": "big", "RowKey": format!("{i:05}") }));
                client.insert_entity(table, &e).await
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    assert!(written.iter().all(Result::is_ok));
    let (all, pages) = read_all(&client, &table, "big", None).await;
    assert_eq!(pages, 2, "1,000 then 105");
    assert_eq!(all.len(), 1105);
    let rows: Vec<&str> = all.iter().map(|e| e["RowKey"].as_str().unwrap()).collect();
    let mut sorted = rows.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(rows, sorted, "each once, in order");
    assert_eq!(client.counters().snapshot().get(Op::HistoryRead), 2);
    client.delete_table(&table).await.unwrap();
}

/// A batch (entity group transaction) writes up to 100 entities of one partition in one
/// request, all or none: a missing table and a duplicate key are told apart as for one insert,
/// and a batch the service could never take is refused before anything is sent.
#[tokio::test]
async fn a_batch_writes_a_partitions_entities_in_one_request_all_or_none() {
    let client = client();
    let table = table_name();
    let row =
        |p: &str, r: usize| entity(json!({ "PartitionKey": p, "RowKey": format!("{r:03}"), "N": r as i64 }));
    let e = client.insert_batch(&table, &[row("p", 1)]).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::NotFound, "{e}");
    assert_eq!(e.code(), Some(TABLE_NOT_FOUND), "{e}");
    assert!(client.create_table(&table).await.unwrap());
    let before = client.counters().snapshot();
    let rows: Vec<Entity> = (0..100).map(|r| row("p", r)).collect();
    client.insert_batch(&table, &rows).await.unwrap();
    assert_eq!(
        client.counters().snapshot().since(&before).get(Op::HistoryWrite),
        1,
        "one request for 100 entities"
    );
    let (all, _) = read_all(&client, &table, "p", None).await;
    assert_eq!(all.len(), 100);
    assert_eq!(all[42]["N"], 42);
    // A key that exists fails the whole transaction: nothing of it is written.
    let e = client
        .insert_batch(&table, &[row("p", 200), row("p", 5)])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ENTITY_ALREADY_EXISTS), "{e}");
    assert_eq!(
        read_all(&client, &table, "p", None).await.0.len(),
        100,
        "all or none"
    );
    let before = client.counters().snapshot();
    for bad in [
        vec![],
        (0..101).map(|r| row("q", r)).collect(),
        vec![row("q", 1), row("r", 2)],
    ] {
        assert_eq!(
            client.insert_batch(&table, &bad).await.unwrap_err().kind(),
            StoreErrorKind::Rejected
        );
    }
    assert_eq!(client.counters().snapshot().since(&before).total(), 0);
    assert!(client.delete_table(&table).await.unwrap());
}
