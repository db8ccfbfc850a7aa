//! Flow control: what lets a due job start now. The limits a job carries (concurrency and
//! rate, per key) and queue-wide concurrency limits ([`limits`]), the claim's admission of
//! candidates within them, decided under the queue's and the keys' locks ([`admission`]),
//! paused queues ([`pause`](mod@pause)), strict order per key ([`sequences`]), fair shares across tenants ([`fairness`]), and a queue's depth counted up to a bound for
//! monitors that poll often ([`depth`]).

pub(crate) mod admission;
pub(crate) mod depth;
pub(crate) mod fairness;
pub(crate) mod limits;
pub(crate) mod pause;
pub(crate) mod sequences;

pub use depth::{MAX_DEPTH_BOUND, QueueCounts, QueueDepth, queue_counts, queue_depth};
pub use fairness::{MAX_FAIR_WEIGHT, set_fair_weight};
pub use limits::{
    KeyState, Limit, MAX_LIMIT, MAX_LIMITS, Rate, key_states, limit_queue, limits_of, queue_limits,
};
pub use pause::{is_paused, pause, resume};
pub use sequences::SequenceFailure;
