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
