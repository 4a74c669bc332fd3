//! Which queues each queue thread serves and which CPU it runs on: the plan is made
//! once, while standing by, before any thread or ring exists.
//!
//! On the batched path any thread may serve any tag: with fewer threads than queues
//! each thread serves a set of queues; with more, several threads arm FETCH on the same
//! queue and the kernel hands each batch of tags to one of them. A tag is handled start
//! to finish by the thread that fetched it, so no per-tag state is shared between
//! threads. On the per-I/O path a queue belongs to one task, so there are at most as
//! many threads as queues ([`plan_for`]).

use nix::sched::{self, CpuSet};
use nix::unistd::Pid;
use ublkd_proto::msg::DataPath;

/// Which queues a thread serves, and which of them it PREPs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadPlan {
    pub index: usize,
    pub queues: Vec<u16>,
    /// Each queue is PREPed by exactly one thread (its lowest-numbered server).
    pub prep_queues: Vec<u16>,
}

/// The plan for a device served with `path`: [`plan`], with at most one thread per
/// queue on the per-I/O path (the kernel binds each queue to one task there; the
/// shared region's slots of threads beyond that stay unused).
pub fn plan_for(path: DataPath, nr_threads: u16, nr_queues: u16) -> Vec<ThreadPlan> {
    match path {
        DataPath::Batch => plan(nr_threads, nr_queues),
        DataPath::PerIo => plan(nr_threads.min(nr_queues), nr_queues),
    }
}

/// Spreads `nr_queues` over `nr_threads`: round robin, every queue served by at least
/// one thread and every thread serving at least one queue.
pub fn plan(nr_threads: u16, nr_queues: u16) -> Vec<ThreadPlan> {
    let (t, q) = (usize::from(nr_threads.max(1)), nr_queues.max(1));
    (0..t)
        .map(|index| {
            let queues: Vec<u16> = if t <= usize::from(q) {
                (0..q).filter(|qid| usize::from(*qid) % t == index).collect()
            } else {
                vec![(index % usize::from(q)) as u16]
            };
            // The lowest thread serving a queue: with t <= q that is the only one;
            // with t > q it is thread number qid.
            let prep_queues = queues
                .iter()
                .copied()
                .filter(|qid| t <= usize::from(q) || usize::from(*qid) == index)
                .collect();
            ThreadPlan { index, queues, prep_queues }
        })
        .collect()
}

/// The CPU queue thread `thread` of device `dev_id` runs on: each on its own, spread
/// by device and thread number over `cpus` (see [`allowed_cpus`]); `None` if there are
/// none to choose from.
pub fn cpu_of(cpus: &[usize], dev_id: u32, thread: usize) -> Option<usize> {
    (!cpus.is_empty()).then(|| cpus[(dev_id as usize + thread) % cpus.len()])
}

/// The CPUs the calling thread may run on now. Read once, before any thread is pinned
/// (a thread inherits its creator's pinning).
pub fn allowed_cpus() -> Vec<usize> {
    let Ok(set) = sched::sched_getaffinity(Pid::from_raw(0)) else { return Vec::new() };
    (0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect()
}

/// Pins the calling thread to `cpu`. Best effort: a failure leaves it unpinned.
///
/// Why: on the loop target the queue thread, io_uring's iou-wrk worker that runs the
/// reads and writes (tmpfs and overlayfs files cannot be read without blocking, so
/// every target I/O goes through io-wq) and the application all compete for the CPUs;
/// a pinned queue thread (what kublk does with its queue's first CPU) serves loop I/O
/// markedly faster and null I/O no slower (bench/results/history.md, "The loop target:
/// where the time goes", "Pinning the queue thread").
pub fn pin_to_cpu(cpu: usize) {
    let mut set = CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = sched::sched_setaffinity(Pid::from_raw(0), &set);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_threads_than_queues_split_queues_round_robin() {
        let p = plan(2, 4);
        assert_eq!(p[0].queues, [0, 2]);
        assert_eq!(p[1].queues, [1, 3]);
        assert_eq!(p[0].prep_queues, [0, 2]);
        assert_eq!(p[1].prep_queues, [1, 3]);
    }

    #[test]
    fn more_threads_than_queues_share_queues_and_prep_once() {
        let p = plan(4, 2);
        let served: Vec<Vec<u16>> = p.iter().map(|t| t.queues.clone()).collect();
        assert_eq!(served, [vec![0], vec![1], vec![0], vec![1]]);
        let preps: Vec<u16> = p.iter().flat_map(|t| t.prep_queues.clone()).collect();
        assert_eq!(preps, [0, 1]);
    }

    #[test]
    fn every_queue_is_prepped_exactly_once() {
        for threads in 1..=9u16 {
            for queues in 1..=9u16 {
                let mut preps: Vec<u16> =
                    plan(threads, queues).iter().flat_map(|t| t.prep_queues.clone()).collect();
                preps.sort_unstable();
                assert_eq!(
                    preps,
                    (0..queues).collect::<Vec<_>>(),
                    "{threads} threads, {queues} queues"
                );
                assert!(plan(threads, queues).iter().all(|t| !t.queues.is_empty()));
            }
        }
    }

    #[test]
    fn per_io_plans_give_each_queue_exactly_one_thread() {
        for threads in 1..=9u16 {
            for queues in 1..=9u16 {
                let p = plan_for(DataPath::PerIo, threads, queues);
                assert_eq!(p.len(), usize::from(threads.min(queues)));
                let mut served: Vec<u16> = p.iter().flat_map(|t| t.queues.clone()).collect();
                served.sort_unstable();
                assert_eq!(served, (0..queues).collect::<Vec<_>>(), "{threads}/{queues}");
                assert!(p.iter().all(|t| t.queues == t.prep_queues));
            }
        }
        assert_eq!(plan_for(DataPath::Batch, 4, 2).len(), 4);
    }

    #[test]
    fn threads_spread_over_the_allowed_cpus_by_device() {
        let cpus = [2, 5, 7];
        assert_eq!(cpu_of(&cpus, 0, 0), Some(2));
        assert_eq!(cpu_of(&cpus, 0, 1), Some(5));
        assert_eq!(cpu_of(&cpus, 1, 0), Some(5));
        assert_eq!(cpu_of(&cpus, 1, 2), Some(2));
        assert_eq!(cpu_of(&[], 4, 1), None);
    }
}
