//! The task's current trace context: the traceparent of the session a worker task is
//! advancing. The worker sets it (`skein_runtime::spans::set_current`); a backend reads
//! it with [`current`] and sends it along with the jobs, notices and results it publishes,
//! so a trace follows the work from one worker to the next.

use std::cell::RefCell;
use std::future::Future;

tokio::task_local! {
    static CURRENT: RefCell<Option<String>>;
}

/// Runs `fut` with a current trace context of its own (none until [`set`]). Not an
/// `async fn`: one would hold `fut` twice (as its argument, and inside the scope it
/// awaits), doubling the size of every future it wraps.
pub fn scoped<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    CURRENT.scope(RefCell::new(None), fut)
}

/// Makes `traceparent` (or nothing) the current trace context of this task's scope. Outside
/// a [`scoped`] future it does nothing.
pub fn set(traceparent: Option<String>) {
    let _ = CURRENT.try_with(|c| *c.borrow_mut() = traceparent);
}

/// The current trace context as a traceparent, if the task has one.
pub fn current() -> Option<String> {
    CURRENT.try_with(|c| c.borrow().clone()).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_scope_holds_its_own_context() {
        assert_eq!(current(), None, "no scope, no context");
        set(Some("outside".into()));
        assert_eq!(current(), None, "setting outside a scope is a no-op");
        let inner = scoped(async {
            assert_eq!(current(), None);
            set(Some("00-a-b-01".into()));
            let nested = scoped(async { current() }).await;
            (current(), nested)
        })
        .await;
        assert_eq!(inner, (Some("00-a-b-01".into()), None));
        assert_eq!(current(), None);
    }
}
