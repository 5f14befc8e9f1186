//! What the filter does with the relay's stream: each `Update` becomes index events for
//! every VM, and the stream's state decides which workers are engine-fed.
//!
//! A stream starts with a snapshot (every worker cleared, then all it holds) and goes on with
//! deltas; `seq` counts updates per stream. A gap or a snapshot that never ends means the
//! state may be wrong: the stream is dropped and reopened, and a new stream starts over with
//! a snapshot. Until a worker has had a complete snapshot, it stays on predictions.

use super::wire::{Phase, Update};
use crate::events::Event;
use crate::ids::WorkerId;

/// Why a stream must be dropped and reopened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedError {
    /// An update out of sequence: one was lost or repeated.
    Sequence { want: u64, got: u64 },
    /// A delta before the snapshot was complete, or a snapshot part after it.
    Phase(i32),
}

impl core::fmt::Display for FeedError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            FeedError::Sequence { want, got } => {
                write!(f, "relay update {got} out of sequence (expected {want})")
            }
            FeedError::Phase(p) => write!(f, "relay update in unexpected phase {p}"),
        }
    }
}

/// What one update did, for counters.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    pub removed: u64,
    /// Deltas for workers this filter does not know (relay and filter configs differ).
    pub unknown_workers: u64,
    /// The update completed the snapshot: the stream is now live.
    pub went_live: bool,
}

/// One stream's progress and the workers it feeds.
#[derive(Debug, Default)]
pub struct Feed {
    next_seq: u64,
    live: bool,
    epoch: u64,
    /// Workers currently engine-fed.
    fed: Vec<bool>,
    /// Workers described by the current snapshot so far.
    in_snapshot: Vec<bool>,
    /// Workers the relay marked stale.
    stale: Vec<bool>,
}

fn set(v: &mut Vec<bool>, w: WorkerId, on: bool) -> bool {
    let i = usize::from(w);
    if v.len() <= i {
        v.resize(i + 1, false);
    }
    v.get_mut(i)
        .map(|x| core::mem::replace(x, on))
        .unwrap_or(false)
}

fn get(v: &[bool], w: WorkerId) -> bool {
    v.get(usize::from(w)).copied().unwrap_or(false)
}

impl Feed {
    pub fn new() -> Feed {
        Feed {
            next_seq: 1,
            ..Feed::default()
        }
    }

    /// Whether the current stream has delivered its whole snapshot.
    pub fn is_live(&self) -> bool {
        self.live
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Workers engine-fed now.
    pub fn fed_workers(&self) -> usize {
        self.fed.iter().filter(|&&f| f).count()
    }

    /// A new stream is opened: it must start with update 1, a snapshot. Workers stay fed
    /// until `lost` (the new snapshot replaces their state without a gap in between).
    pub fn restart(&mut self) {
        self.next_seq = 1;
        self.live = false;
        self.in_snapshot.clear();
    }

    /// The stream is gone: every worker goes back to predictions.
    pub fn lost(&mut self) -> Vec<Event> {
        self.restart();
        let mut out = Vec::new();
        for (i, f) in self.fed.iter_mut().enumerate() {
            if core::mem::take(f) {
                if let Ok(worker) = WorkerId::try_from(i) {
                    out.push(Event::EngineFeed { worker, on: false });
                }
            }
        }
        out
    }

    /// Turns one update into events, appended to `out`. `worker` maps a relay worker name
    /// to the filter's id. On an error nothing is appended, and the caller drops the stream
    /// (then `lost`, or `restart` for a new one).
    pub fn apply(
        &mut self,
        u: &Update,
        worker: impl Fn(&str) -> Option<WorkerId>,
        out: &mut Vec<Event>,
    ) -> Result<Applied, FeedError> {
        if u.seq != self.next_seq {
            return Err(FeedError::Sequence {
                want: self.next_seq,
                got: u.seq,
            });
        }
        let phase = Phase::try_from(u.phase).map_err(|_| FeedError::Phase(u.phase))?;
        let snapshot = matches!(phase, Phase::Snapshot | Phase::SnapshotEnd);
        if snapshot == self.live {
            return Err(FeedError::Phase(u.phase));
        }
        self.next_seq += 1;
        self.epoch = u.epoch;
        let mut a = Applied::default();
        for d in &u.workers {
            let Some(w) = worker(&d.worker) else {
                a.unknown_workers += 1;
                continue;
            };
            if d.cleared {
                out.push(Event::EngineCleared { worker: w });
            }
            if !d.stored.is_empty() {
                a.stored += d.stored.len() as u64;
                out.push(Event::EngineStored {
                    worker: w,
                    hashes: d.stored.clone(),
                });
            }
            if !d.removed.is_empty() {
                a.removed += d.removed.len() as u64;
                out.push(Event::EngineRemoved {
                    worker: w,
                    hashes: d.removed.clone(),
                });
            }
            if snapshot {
                set(&mut self.in_snapshot, w, true);
            }
            if d.stale {
                set(&mut self.stale, w, true);
                if set(&mut self.fed, w, false) {
                    out.push(Event::EngineFeed {
                        worker: w,
                        on: false,
                    });
                }
            } else if self.live && (d.cleared || get(&self.stale, w)) {
                // A live reset of this worker's state, or the relay's word that its lost
                // engine is back unchanged: from here on the relay describes it.
                set(&mut self.stale, w, false);
                if !set(&mut self.fed, w, true) {
                    out.push(Event::EngineFeed {
                        worker: w,
                        on: true,
                    });
                }
            } else if snapshot {
                set(&mut self.stale, w, false);
            }
        }
        if phase == Phase::SnapshotEnd {
            self.live = true;
            a.went_live = true;
            // Fed from now: workers the snapshot described and not stale. Workers it left
            // out (the relay does not watch them) go back to predictions.
            let n = self.in_snapshot.len().max(self.fed.len());
            for i in 0..n {
                let Ok(w) = WorkerId::try_from(i) else { break };
                let want = get(&self.in_snapshot, w) && !get(&self.stale, w);
                if set(&mut self.fed, w, want) != want {
                    out.push(Event::EngineFeed {
                        worker: w,
                        on: want,
                    });
                }
            }
        }
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precise::wire::WorkerDelta;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn names(n: &str) -> Option<WorkerId> {
        match n {
            "a" => Some(0),
            "b" => Some(1),
            _ => None,
        }
    }

    fn delta(w: &str, cleared: bool, stored: &[u64], removed: &[u64]) -> WorkerDelta {
        WorkerDelta {
            worker: w.into(),
            cleared,
            stored: stored.to_vec(),
            removed: removed.to_vec(),
            stale: false,
        }
    }

    fn update(seq: u64, phase: Phase, workers: Vec<WorkerDelta>) -> Update {
        Update {
            seq,
            epoch: 7,
            phase: phase as i32,
            workers,
            sent_unix_ns: 0,
            ..Update::default()
        }
    }

    /// The events a live update makes.
    fn live(f: &mut Feed, seq: u64, workers: Vec<WorkerDelta>) -> Vec<Event> {
        let mut out = Vec::new();
        f.apply(&update(seq, Phase::Live, workers), names, &mut out)
            .unwrap();
        out
    }

    #[test]
    fn snapshot_then_deltas_feed_the_described_workers_only() {
        let mut f = Feed::new();
        let mut out = Vec::new();
        f.apply(
            &update(1, Phase::Snapshot, vec![delta("a", true, &[1, 2], &[])]),
            names,
            &mut out,
        )
        .unwrap();
        assert!(!f.is_live());
        let a = f
            .apply(
                &update(2, Phase::SnapshotEnd, vec![delta("zz", true, &[9], &[])]),
                names,
                &mut out,
            )
            .unwrap();
        assert!(a.went_live && f.is_live());
        assert_eq!(a.unknown_workers, 1);
        assert_eq!(
            out,
            vec![
                Event::EngineCleared { worker: 0 },
                Event::EngineStored {
                    worker: 0,
                    hashes: vec![1, 2]
                },
                Event::EngineFeed {
                    worker: 0,
                    on: true
                },
            ]
        );
        assert_eq!(
            live(&mut f, 3, vec![delta("a", false, &[3], &[1])]),
            vec![
                Event::EngineStored {
                    worker: 0,
                    hashes: vec![3]
                },
                Event::EngineRemoved {
                    worker: 0,
                    hashes: vec![1]
                },
            ]
        );
        assert_eq!(f.fed_workers(), 1);
    }

    #[test]
    fn gaps_and_phase_errors_drop_the_stream_and_loss_unfeeds() {
        let mut f = Feed::new();
        let mut out = Vec::new();
        // A delta before any snapshot.
        assert_eq!(
            f.apply(&update(1, Phase::Live, vec![]), names, &mut out),
            Err(FeedError::Phase(0))
        );
        f.apply(
            &update(1, Phase::SnapshotEnd, vec![delta("b", true, &[], &[])]),
            names,
            &mut out,
        )
        .unwrap();
        assert_eq!(
            f.apply(&update(3, Phase::Live, vec![]), names, &mut out),
            Err(FeedError::Sequence { want: 2, got: 3 })
        );
        out.clear();
        assert_eq!(
            f.lost(),
            vec![Event::EngineFeed {
                worker: 1,
                on: false
            }]
        );
        assert_eq!(f.fed_workers(), 0);
        // A new stream starts at 1 again.
        assert!(f
            .apply(&update(1, Phase::SnapshotEnd, vec![]), names, &mut out)
            .is_ok());
    }

    #[test]
    fn stale_workers_fall_back_until_the_relay_resets_them() {
        let mut f = Feed::new();
        let mut out = Vec::new();
        f.apply(
            &update(
                1,
                Phase::SnapshotEnd,
                vec![delta("a", true, &[], &[]), delta("b", true, &[], &[])],
            ),
            names,
            &mut out,
        )
        .unwrap();
        assert_eq!(f.fed_workers(), 2);
        out.clear();
        let mut st = delta("b", false, &[], &[]);
        st.stale = true;
        f.apply(&update(2, Phase::Live, vec![st]), names, &mut out)
            .unwrap();
        assert_eq!(
            out,
            vec![Event::EngineFeed {
                worker: 1,
                on: false
            }]
        );
        out.clear();
        // The engine came back unchanged: a delta without `stale` feeds it again.
        f.apply(
            &update(3, Phase::Live, vec![delta("b", false, &[], &[])]),
            names,
            &mut out,
        )
        .unwrap();
        assert_eq!(
            out,
            vec![Event::EngineFeed {
                worker: 1,
                on: true
            }]
        );
        let mut st = delta("b", false, &[], &[]);
        st.stale = true;
        f.apply(&update(4, Phase::Live, vec![st]), names, &mut out)
            .unwrap();
        assert_eq!(
            live(&mut f, 5, vec![delta("b", true, &[5], &[])]),
            vec![
                Event::EngineCleared { worker: 1 },
                Event::EngineStored {
                    worker: 1,
                    hashes: vec![5]
                },
                Event::EngineFeed {
                    worker: 1,
                    on: true
                },
            ]
        );
    }
}
