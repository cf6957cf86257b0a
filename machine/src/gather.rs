//! [`Gather`]: calls made while others are in flight, sent together. Used for
//! the worker's requests to its sidecar and for its reports to the leader.
//!
//! At most [`MAX_EXCHANGES`] exchanges run at once. A call made while
//! nothing is in flight goes at once, alone, on its caller's own task (an
//! idle machine pays for no hand-off). Calls made while others are in
//! flight wait; a task of its own then takes every waiting call it can (in
//! order, up to the [`Exchange`]'s count and byte limits) and sends them as
//! one message. Under load the calls made during one exchange leave
//! together in the next: one message each way, one pass of the receiver's
//! group commit, for many calls.
//!
//! It never changes what an answer means: each caller gets its own answer,
//! from its own request, only once the receiver answered the batch it was
//! in. It never retries: a batch the receiver could not read (an older
//! peer) is sent again one by one, once; everything else is answered. A call
//! whose caller gave up before it was sent is not sent.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

/// Most exchanges in flight at once: one being answered while the next
/// gathers the calls made meanwhile.
pub const MAX_EXCHANGES: usize = 2;

/// How calls travel: alone, or several in one message.
pub trait Exchange: Send + Sync + 'static {
    type Item: Send + 'static;
    type Answer: Send + 'static;
    /// Most items in one batch.
    const MAX_ITEMS: usize;
    /// Most encoded bytes of items in one batch.
    const MAX_BYTES: usize;

    /// Whether `item` may travel with others (else it always goes alone).
    fn batches(&self, item: &Self::Item) -> bool;

    /// `item`'s encoded size, for [`Exchange::MAX_BYTES`].
    fn size(&self, item: &Self::Item) -> usize;

    /// Sends one item (alone) or several (as a batch). One item alone is
    /// always answered.
    fn send(&self, items: Vec<Self::Item>) -> impl Future<Output = Sent<Self::Item, Self::Answer>> + Send;
}

/// What became of one exchange.
pub enum Sent<I, A> {
    /// One answer per item, in order (a failure is an answer too).
    Answered(Vec<A>),
    /// The receiver could not read the batch: nothing of it was applied, and
    /// each item is sent again alone.
    Unread(Vec<I>),
}

/// The calls of one sender, gathered.
pub struct Gather<S: Exchange> {
    inner: Arc<Inner<S>>,
}

struct Inner<S: Exchange> {
    sender: S,
    queue: Mutex<Queue<S::Item, S::Answer>>,
}

struct Queue<I, A> {
    /// Calls not yet sent, in the order they were made.
    waiting: VecDeque<Waiter<I, A>>,
    /// Exchanges running (each a task that sends until the queue is empty).
    exchanges: usize,
}

struct Waiter<I, A> {
    item: I,
    /// Sent alone: it was in a batch the receiver could not read.
    alone: bool,
    answer: oneshot::Sender<A>,
}

impl<S: Exchange> Gather<S> {
    pub fn new(sender: S) -> Gather<S> {
        let queue = Mutex::new(Queue { waiting: VecDeque::new(), exchanges: 0 });
        Gather { inner: Arc::new(Inner { sender, queue }) }
    }

    pub fn sender(&self) -> &S {
        &self.inner.sender
    }

    /// Sends `item` (alone, or with others made meanwhile) and waits at most
    /// `wait` for its answer: `None` when none came in time. Must be called
    /// within a tokio runtime: the exchanges that carry waiting calls run as
    /// tasks of their own, so that a caller giving up never cancels another
    /// caller's exchange (an idle caller's own exchange carries only its
    /// call).
    pub async fn call(&self, item: S::Item, wait: Duration) -> Option<S::Answer> {
        self.call_together(vec![item], wait).await.pop().flatten()
    }

    /// Sends `items` as [`Gather::call`] sends one, but together: in one
    /// exchange, in the order given, when they fit its limits (on an idle
    /// sender, as one batch of their own). Each answer, or `None` when it
    /// did not come within `wait`.
    pub async fn call_together(&self, items: Vec<S::Item>, wait: Duration) -> Vec<Option<S::Answer>> {
        let deadline = tokio::time::Instant::now() + wait;
        let count = items.len();
        let alone = {
            let mut q = self.inner.queue();
            let idle = q.exchanges == 0 && q.waiting.is_empty();
            q.exchanges += usize::from(idle);
            idle
        };
        if alone {
            let _exchange = Alone(&self.inner);
            let sent = tokio::time::timeout_at(deadline, self.inner.sender.send(items)).await;
            let answers = match sent {
                Ok(Sent::Answered(answers)) => answers.into_iter().map(Some).collect(),
                // A batch the receiver could not read: each item again, alone, in order.
                Ok(Sent::Unread(items)) => {
                    let mut answers = Vec::with_capacity(count);
                    for item in items {
                        let sent = tokio::time::timeout_at(deadline, self.inner.sender.send(vec![item])).await;
                        answers.push(match sent {
                            Ok(Sent::Answered(answer)) => answer.into_iter().next(),
                            Ok(Sent::Unread(_)) | Err(_) => None,
                        });
                    }
                    answers
                }
                Err(_) => Vec::new(),
            };
            return padded(answers, count);
        }
        let (waiters, answered): (Vec<_>, Vec<_>) = items
            .into_iter()
            .map(|item| {
                let (answer, answered) = oneshot::channel();
                (Waiter { item, alone: false, answer }, answered)
            })
            .unzip();
        let start = {
            let mut q = self.inner.queue();
            q.waiting.extend(waiters);
            let start = q.exchanges < MAX_EXCHANGES;
            q.exchanges += usize::from(start);
            start
        };
        if start {
            tokio::spawn(run(self.inner.clone()));
        }
        let mut answers = Vec::with_capacity(count);
        for answered in answered {
            answers.push(tokio::time::timeout_at(deadline, answered).await.ok().and_then(Result::ok));
        }
        answers
    }
}

/// `count` answers: those given, then `None` for each missing one.
fn padded<A>(mut answers: Vec<Option<A>>, count: usize) -> Vec<Option<A>> {
    answers.truncate(count);
    answers.resize_with(count, || None);
    answers
}

/// An idle caller's own exchange: when it ends (or its caller gives up),
/// the calls made meanwhile get an exchange of their own if they have none.
struct Alone<'a, S: Exchange>(&'a Arc<Inner<S>>);

impl<S: Exchange> Drop for Alone<'_, S> {
    fn drop(&mut self) {
        let mut q = self.0.queue();
        q.exchanges -= 1;
        if q.waiting.is_empty() || q.exchanges >= MAX_EXCHANGES {
            return;
        }
        // Dropped outside a runtime (it is shutting down): nobody waits.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            q.exchanges += 1;
            runtime.spawn(run(self.0.clone()));
        }
    }
}

impl<S: Exchange> Inner<S> {
    fn queue(&self) -> MutexGuard<'_, Queue<S::Item, S::Answer>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next calls to send together (none: the queue is empty), skipping
    /// those whose caller is gone.
    fn next_batch(&self) -> Vec<Waiter<S::Item, S::Answer>> {
        let mut q = self.queue();
        q.waiting.retain(|w| !w.answer.is_closed());
        let Some(first) = q.waiting.pop_front() else { return Vec::new() };
        let together = |w: &Waiter<S::Item, S::Answer>| !w.alone && self.sender.batches(&w.item);
        let batches = together(&first);
        let mut bytes = self.sender.size(&first.item);
        let mut batch = vec![first];
        while batches && batch.len() < S::MAX_ITEMS {
            let Some(next) = q.waiting.front() else { break };
            let size = self.sender.size(&next.item);
            if !together(next) || bytes + size > S::MAX_BYTES {
                break;
            }
            bytes += size;
            batch.extend(q.waiting.pop_front());
        }
        batch
    }
}

/// One exchange's loop: sends what waits until nothing does.
async fn run<S: Exchange>(inner: Arc<Inner<S>>) {
    loop {
        let batch = inner.next_batch();
        if batch.is_empty() {
            let mut q = inner.queue();
            // A call may have come between the empty look and this lock.
            if q.waiting.is_empty() {
                q.exchanges -= 1;
                return;
            }
            continue;
        }
        let (items, answers): (Vec<_>, Vec<_>) = batch.into_iter().map(|w| (w.item, w.answer)).unzip();
        match inner.sender.send(items).await {
            Sent::Answered(replies) => {
                for (answer, reply) in answers.into_iter().zip(replies) {
                    let _ = answer.send(reply);
                }
            }
            Sent::Unread(items) => {
                let mut q = inner.queue();
                for (item, answer) in items.into_iter().zip(answers).rev() {
                    q.waiting.push_front(Waiter { item, alone: true, answer });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Records what it was sent; answers each item with itself times ten,
    /// and refuses to read batches while `unreadable` is set.
    struct Echo {
        sent: Mutex<Vec<Vec<u32>>>,
        unreadable: AtomicBool,
        gate: tokio::sync::Semaphore,
    }

    impl Exchange for Echo {
        type Item = u32;
        type Answer = u32;
        const MAX_ITEMS: usize = 3;
        const MAX_BYTES: usize = 100;

        fn batches(&self, item: &u32) -> bool {
            (1..100).contains(item)
        }

        fn size(&self, item: &u32) -> usize {
            *item as usize
        }

        async fn send(&self, items: Vec<u32>) -> Sent<u32, u32> {
            self.sent.lock().unwrap().push(items.clone());
            // In flight for a moment at least: calls made meanwhile wait.
            tokio::task::yield_now().await;
            let _pass = self.gate.acquire().await;
            if items.len() > 1 && self.unreadable.load(Ordering::SeqCst) {
                return Sent::Unread(items);
            }
            Sent::Answered(items.iter().map(|i| i * 10).collect())
        }
    }

    fn echo(open: bool) -> Gather<Echo> {
        let gate = tokio::sync::Semaphore::new(if open { 1000 } else { 0 });
        Gather::new(Echo { sent: Mutex::new(Vec::new()), unreadable: AtomicBool::new(false), gate })
    }

    const WAIT: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn one_call_goes_alone_and_calls_made_together_go_together_within_the_limits() {
        let g = echo(true);
        assert_eq!(g.call(7, WAIT).await, Some(70));
        // Made together: 1 goes at once, alone; 2..=4 fill a batch of three
        // (the limit); 0 never travels with others; 60 and 50 would pass
        // 100 bytes.
        let calls = [1, 2, 3, 4, 0, 5, 60, 50].map(|i| g.call(i, WAIT));
        let answers = futures::future::join_all(calls).await;
        assert_eq!(answers, [10, 20, 30, 40, 0, 50, 600, 500].map(Some));
        let sent = g.sender().sent.lock().unwrap().clone();
        assert_eq!(sent, [vec![7], vec![1], vec![2, 3, 4], vec![0], vec![5, 60], vec![50]]);
    }

    #[tokio::test]
    async fn a_batch_that_cannot_be_read_is_sent_again_one_by_one() {
        let g = echo(true);
        g.sender().unreadable.store(true, Ordering::SeqCst);
        let answers = futures::future::join_all([1, 2, 3, 4].map(|i| g.call(i, WAIT))).await;
        assert_eq!(answers, [10, 20, 30, 40].map(Some));
        let sent = g.sender().sent.lock().unwrap().clone();
        assert_eq!(sent, [vec![1], vec![2, 3, 4], vec![2], vec![3], vec![4]]);
        // Only that batch: the next calls are tried together again.
        g.sender().unreadable.store(false, Ordering::SeqCst);
        let answers = futures::future::join_all([5, 6, 7].map(|i| g.call(i, WAIT))).await;
        assert_eq!(answers, [50, 60, 70].map(Some));
        assert_eq!(g.sender().sent.lock().unwrap().last(), Some(&vec![6, 7]));
    }

    #[tokio::test]
    async fn a_call_given_up_before_it_was_sent_is_never_sent() {
        let g = Arc::new(echo(false));
        // Two exchanges (the first on its caller's task), each held at the
        // gate with its call alone.
        let held: Vec<_> = [100, 200]
            .map(|i| {
                let g = g.clone();
                tokio::spawn(async move { g.call(i, WAIT).await })
            })
            .into_iter()
            .collect();
        for _ in 0..1000 {
            let busy = {
                let q = g.inner.queue();
                q.exchanges == MAX_EXCHANGES && q.waiting.is_empty()
            };
            if busy {
                break;
            }
            tokio::task::yield_now().await;
        }
        // A third waits its turn, and its caller gives up.
        assert_eq!(g.call(3, Duration::from_millis(20)).await, None);
        g.sender().gate.add_permits(1000);
        for (h, want) in held.into_iter().zip([1000, 2000]) {
            assert_eq!(h.await.unwrap(), Some(want));
        }
        assert_eq!(g.call(4, WAIT).await, Some(40));
        let sent: Vec<u32> = g.sender().sent.lock().unwrap().concat();
        assert!(!sent.contains(&3), "{sent:?}");
        assert!(sent.contains(&4), "{sent:?}");
    }

    #[tokio::test]
    async fn calls_made_together_travel_in_one_exchange_idle_or_busy() {
        let g = echo(true);
        // Idle: the two are one batch of their own, not one alone and the
        // other after it.
        assert_eq!(g.call_together(vec![1, 2], WAIT).await, [Some(10), Some(20)]);
        // Busy (two exchanges carry 3 and 4): the pair waits and leaves
        // together, in its order, with what was made before it.
        let (a, b, pair) = tokio::join!(g.call(3, WAIT), g.call(4, WAIT), g.call_together(vec![6, 5], WAIT));
        assert_eq!((a, b), (Some(30), Some(40)));
        assert_eq!(pair, [Some(60), Some(50)]);
        let sent = g.sender().sent.lock().unwrap().clone();
        assert_eq!(sent, [vec![1, 2], vec![3], vec![4, 6, 5]]);
    }

    #[tokio::test]
    async fn calls_together_that_cannot_be_read_as_a_batch_go_one_by_one_in_order() {
        let g = echo(true);
        g.sender().unreadable.store(true, Ordering::SeqCst);
        assert_eq!(g.call_together(vec![1, 2, 3], WAIT).await, [Some(10), Some(20), Some(30)]);
        let sent = g.sender().sent.lock().unwrap().clone();
        assert_eq!(sent, [vec![1, 2, 3], vec![1], vec![2], vec![3]]);
        // A caller that gives up gets `None` for each.
        let held = echo(false);
        assert_eq!(held.call_together(vec![1, 2], Duration::from_millis(20)).await, [None, None]);
    }
}
