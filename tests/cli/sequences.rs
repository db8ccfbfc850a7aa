//! Sequences from the command line: `tenure enqueue --sequence`, what `tenure jobs show` says
//! of a job a dead one holds back, and `tenure jobs skip-in-sequence` letting the rest go on.

use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, Retry};

use crate::common::{TestDb, conformance};
use crate::{json, ok, tenure};

conformance!(show_says_what_holds_a_sequence_and_skip_lets_it_go_on,);

fn show_says_what_holds_a_sequence_and_skip_lets_it_go_on(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let enqueue = || {
        json(
            url,
            &[
                "enqueue",
                "--queue",
                "q",
                "--kind",
                "k",
                "--sequence",
                "account-7",
            ],
        )["id"]
            .as_i64()
            .unwrap()
    };
    let (first, second) = (enqueue(), enqueue());
    let shown = ok(url, &["jobs", "show", &second.to_string()]);
    assert!(
        shown.contains(&format!("account-7, after #{first} (waiting)")),
        "{shown}"
    );
    let mut conn = db.connect();
    let claimed = jobs::claim(&mut conn, "q", 10, Duration::from_secs(60)).unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![first]
    );
    jobs::fail(&mut conn, claimed[0].claim(), "broken", Retry::Never).unwrap();
    let shown = ok(url, &["jobs", "show", &second.to_string()]);
    for words in [
        format!("held by #{first} dead"),
        format!("tenure jobs retry {first}"),
        format!("tenure jobs skip-in-sequence {first}"),
    ] {
        assert!(shown.contains(&words), "{words:?} missing from: {shown}");
    }
    assert_eq!(
        json(url, &["jobs", "show", &second.to_string()])["sequence_key"],
        "account-7"
    );
    // Skipping a job that holds nothing back is refused, and says why.
    let out = tenure(url, &["jobs", "skip-in-sequence", &second.to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("holds no job of a sequence back"), "{said}");
    let skipped = json(url, &["jobs", "skip-in-sequence", &first.to_string()]);
    assert_eq!(skipped["released"], 1);
    let claimed = jobs::claim(&mut conn, "q", 10, Duration::from_secs(60)).unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![second]
    );
}
