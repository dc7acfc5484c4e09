//! Opening the embedded store.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use skein_sled::SledStore;

#[tokio::test]
async fn a_second_opener_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let _a = SledStore::open(dir.path(), dir.path()).unwrap();
    let e = SledStore::open(dir.path(), dir.path())
        .err()
        .expect("second open refused");
    assert!(
        e.to_string().contains("is in use by another skein process"),
        "{e}"
    );
    assert!(
        e.to_string().contains(&dir.path().display().to_string()),
        "{e}"
    );
}

#[tokio::test]
async fn an_open_waits_for_a_database_handle_of_this_process_that_is_closing() {
    let dir = tempfile::tempdir().unwrap();
    let held = sled::open(dir.path().join("db")).unwrap();
    // The contention is real: sled refuses a second handle while this one lives.
    let second = sled::open(dir.path().join("db")).expect_err("refused");
    assert!(
        second.to_string().contains("could not acquire lock"),
        "{second}"
    );
    let (opening_tx, opening_rx) = std::sync::mpsc::channel();
    let closer = std::thread::spawn(move || {
        opening_rx.recv().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
    });
    opening_tx.send(()).unwrap();
    let store = SledStore::open(dir.path(), dir.path());
    closer.join().unwrap();
    assert!(store.is_ok(), "{:?}", store.err());
}
