//! The `kvroute.relay.v1.Relay/Watch` server stream, written by hand on tonic's server
//! machinery (no protoc, no codegen): bidirectional; a snapshot first, then coalesced live
//! deltas and the other gateways' decisions; the gateway's later messages carry its decisions.

use crate::auth::Refusal;
use crate::clock::now_ns;
use crate::counter::add;
use crate::hub::{Change, Hub, Refused, StreamSlot};
use crate::index::DeltaBuilder;
use crate::share::PeerEvent;
use crate::streaming::{self, BoxFuture, OpenResult, StreamMethod};
use kvroute::precise::wire::{Phase, Update, WatchRequest, WorkerDelta, METHOD, SERVICE};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Peer events gathered into one Update at most.
pub const PEER_CHUNK: usize = 1024;

/// Most hashes in one snapshot update.
pub const SNAPSHOT_CHUNK: usize = 32768;
/// A live update is sent once it holds this many hashes, or once no more changes are waiting.
pub const LIVE_CHUNK: usize = 4096;

/// The gRPC service (clone per connection).
#[derive(Clone)]
pub struct RelayService {
    hub: Arc<Hub>,
}

impl RelayService {
    pub fn new(hub: Arc<Hub>) -> Self {
        RelayService { hub }
    }
}

impl StreamMethod for RelayService {
    const SERVICE: &'static str = SERVICE;
    const METHOD: &'static str = METHOD;
    type In = WatchRequest;
    type Out = Update;

    // Before anything else: a caller without the token learns nothing (not even which
    // methods exist) and nothing it sends is read.
    fn admit(&self, headers: &http::HeaderMap) -> Result<(), Box<Status>> {
        let authorization = headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        self.hub.auth.check(authorization).map_err(|why| {
            Box::new(Status::unauthenticated(match why {
                Refusal::Missing => "no relay token: send `authorization: Bearer <token>` (the filter's relay.token_env)",
                Refusal::Wrong => "wrong relay token",
            }))
        })
    }

    fn open(&self, request: Request<Streaming<WatchRequest>>) -> BoxFuture<OpenResult<Update>> {
        let hub = self.hub.clone();
        // Stream limits (README, "Limits"): the place is held until the stream ends.
        let slot = open_slot(&hub, request.remote_addr().map(|a| a.ip()));
        Box::pin(async move {
            let slot = slot.map_err(|s| *s)?;
            let mut inbound = request.into_inner();
            let req = match inbound.message().await? {
                Some(r) => r,
                None => {
                    return Err(Status::invalid_argument(
                        "no WatchRequest: the first message must name the gateway",
                    ))
                }
            };
            if req.gateway.is_empty() {
                return Err(Status::invalid_argument(
                    "WatchRequest.gateway is empty: the first message must name the gateway",
                ));
            }
            if req.block_size != hub.block_size {
                return Err(Status::failed_precondition(format!(
                    "block_size mismatch: gateway {:?} hashes blocks of {} tokens, this relay re-keys blocks of {} tokens (set the relay's --block-size or the filter's block_size so they agree)",
                    req.gateway, req.block_size, hub.block_size
                )));
            }
            // Not the group: it names the gateways' replication namespace, which is theirs.
            eprintln!(
                "kvroute-relay: stream opened for {:?} (block_size {})",
                req.gateway, req.block_size
            );
            let (id, peers) = hub.share.register(&req.gateway, &req.group);
            hub.share.local_decisions(id, req.decisions);
            let (tx, rx) = mpsc::channel(4);
            tokio::spawn(async move {
                stream_task(hub, req.gateway, id, peers, inbound, tx).await;
                drop(slot);
            });
            Ok(Response::new(ReceiverStream::new(rx)))
        })
    }
}

struct Stream {
    hub: Arc<Hub>,
    tx: mpsc::Sender<Result<Update, Status>>,
    seq: u64,
}

impl Stream {
    async fn send(&mut self, phase: Phase, workers: Vec<WorkerDelta>) -> bool {
        let u = Update {
            phase: phase as i32,
            workers,
            ..Update::default()
        };
        self.send_update(u).await
    }

    async fn send_update(&mut self, mut u: Update) -> bool {
        self.seq += 1;
        u.seq = self.seq;
        u.epoch = self.hub.epoch;
        u.sent_unix_ns = now_ns();
        if self.tx.send(Ok(u)).await.is_err() {
            return false;
        }
        add(&self.hub.stats.updates_sent, 1);
        true
    }

    /// One LIVE Update of `first` and the peer events queued behind it.
    async fn send_peers(
        &mut self,
        first: PeerEvent,
        queue: &mut mpsc::Receiver<PeerEvent>,
    ) -> bool {
        let mut u = Update {
            phase: Phase::Live as i32,
            ..Update::default()
        };
        let mut next = Some(first);
        let mut n = 0;
        while let Some(ev) = next.take() {
            match ev {
                PeerEvent::Decisions(p) => u.peers.push(Arc::unwrap_or_clone(p)),
                PeerEvent::Gone(g) => u.gone.push(g.to_string()),
            }
            n += 1;
            if n < PEER_CHUNK {
                next = queue.try_recv().ok();
            }
        }
        let sent: Vec<(u64, u64)> = u
            .peers
            .iter()
            .map(|p| (p.sent_unix_ns, p.decisions.len() as u64))
            .collect();
        if !self.send_update(u).await {
            return false;
        }
        let now = now_ns();
        let share = &self.hub.share.stats;
        for (at, k) in sent {
            share.delay.observe_ns(now.saturating_sub(at));
            add(&share.forwarded, k);
        }
        true
    }

    /// Subscribes and copies the state under one lock, then sends the snapshot.
    async fn snapshot(&mut self) -> Option<broadcast::Receiver<Arc<Vec<Change>>>> {
        let (rx, parts) = {
            let st = self.hub.lock();
            let rx = st.tx.subscribe();
            let (parts, cut) = st.snapshot_parts(self.hub.limits.max_snapshot_blocks);
            add(&self.hub.stats.snapshot_truncated, cut as u64);
            (rx, parts)
        };
        let mut pending: Vec<WorkerDelta> = Vec::new();
        let mut in_update = 0usize;
        for (name, stale, hashes) in parts {
            let mut first = true;
            let mut rest = hashes.as_slice();
            while first || !rest.is_empty() {
                let room = SNAPSHOT_CHUNK - in_update;
                let (now, later) = rest.split_at(rest.len().min(room));
                pending.push(WorkerDelta {
                    worker: name.clone(),
                    cleared: first,
                    stored: now.to_vec(),
                    removed: Vec::new(),
                    stale,
                });
                first = false;
                in_update += now.len();
                rest = later;
                if in_update >= SNAPSHOT_CHUNK {
                    let w = std::mem::take(&mut pending);
                    in_update = 0;
                    if !self.send(Phase::Snapshot, w).await {
                        return None;
                    }
                }
            }
        }
        if !self.send(Phase::SnapshotEnd, pending).await {
            return None;
        }
        Some(rx)
    }
}

fn open_slot(hub: &Hub, client: Option<std::net::IpAddr>) -> Result<StreamSlot, Box<Status>> {
    let limits = &hub.limits;
    hub.streams.open(client, limits).map_err(|why| {
        let (counter, msg) = match why {
            Refused::PerClient => (
                &hub.stats.streams_refused_per_client,
                format!(
                    "{} Watch streams are open from this address already (--max-streams-per-client)",
                    limits.max_streams_per_client
                ),
            ),
            Refused::Total => (
                &hub.stats.streams_refused_total,
                format!(
                    "{} Watch streams are open already (--max-streams)",
                    limits.max_streams
                ),
            ),
        };
        add(counter, 1);
        Box::new(Status::resource_exhausted(msg))
    })
}

fn names(hub: &Hub) -> Vec<String> {
    hub.lock().workers.iter().map(|w| w.name.clone()).collect()
}

async fn stream_task(
    hub: Arc<Hub>,
    gateway: String,
    id: u64,
    mut peers: mpsc::Receiver<PeerEvent>,
    mut inbound: Streaming<WatchRequest>,
    tx: mpsc::Sender<Result<Update, Status>>,
) {
    add(&hub.stats.streams_open, 1);
    add(&hub.stats.streams_total, 1);
    // The gateway's later messages: its decisions. A half-close (older filters send one
    // message) ends only this reader, not the stream.
    let share = hub.share.clone();
    let reader = tokio::spawn(async move {
        while let Ok(Some(m)) = inbound.message().await {
            share.local_decisions(id, m.decisions);
        }
    });
    let mut s = Stream {
        hub: hub.clone(),
        tx,
        seq: 0,
    };
    live(&mut s, &mut peers).await;
    reader.abort();
    hub.share.unregister(id);
    hub.stats.streams_open.fetch_sub(1, Relaxed);
    eprintln!("kvroute-relay: stream for {gateway:?} closed");
}

async fn live(s: &mut Stream, peers: &mut mpsc::Receiver<PeerEvent>) {
    let Some(mut rx) = s.snapshot().await else {
        return;
    };
    loop {
        // Wait for the first change, then gather what is already waiting: no timer, so an
        // engine event leaves at once (a 1 ms window cost 1-2 ms on tokio's timer wheel),
        // while under load the changes that queued during the previous send go together.
        let mut pending: BTreeMap<usize, DeltaBuilder> = BTreeMap::new();
        let mut hashes = 0usize;
        let mut oldest: Option<u64> = None;
        let mut lagged = false;
        let mut closed = false;
        let first = tokio::select! {
            r = rx.recv() => r,
            Some(ev) = peers.recv() => {
                if !s.send_peers(ev, peers).await {
                    return;
                }
                continue;
            }
            () = s.tx.closed() => return,
        };
        let mut next = Some(first);
        while let Some(r) = next.take() {
            match r {
                Ok(changes) => {
                    for c in changes.iter() {
                        if c.engine_ns > 0 {
                            oldest = Some(oldest.map_or(c.engine_ns, |o: u64| o.min(c.engine_ns)));
                        }
                        let b = pending.entry(c.worker).or_default();
                        b.merge(&c.delta);
                        hashes += c.delta.stored.len() + c.delta.removed.len();
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    lagged = true;
                    break;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    closed = true;
                    break;
                }
            }
            if hashes >= LIVE_CHUNK {
                break;
            }
            next = match rx.try_recv() {
                Ok(c) => Some(Ok(c)),
                Err(broadcast::error::TryRecvError::Empty) => None,
                Err(broadcast::error::TryRecvError::Lagged(n)) => {
                    Some(Err(broadcast::error::RecvError::Lagged(n)))
                }
                Err(broadcast::error::TryRecvError::Closed) => {
                    Some(Err(broadcast::error::RecvError::Closed))
                }
            };
        }
        if lagged {
            add(&s.hub.stats.lagged_resnapshots, 1);
            eprintln!("kvroute-relay: a stream fell behind; sending it a fresh snapshot");
            match s.snapshot().await {
                Some(r) => rx = r,
                None => return,
            }
            continue;
        }
        if !pending.is_empty() {
            let names = names(&s.hub);
            let workers = pending
                .into_iter()
                .filter_map(|(i, b)| {
                    let d = b.finish();
                    Some(WorkerDelta {
                        worker: names.get(i)?.clone(),
                        cleared: d.cleared,
                        stored: d.stored,
                        removed: d.removed,
                        stale: d.stale,
                    })
                })
                .collect();
            let u = Update {
                phase: Phase::Live as i32,
                workers,
                engine_unix_ns: oldest.unwrap_or(0),
                ..Update::default()
            };
            if !s.send_update(u).await {
                return;
            }
        }
        if closed {
            return;
        }
    }
}

/// Serves the Relay service on `listener` (HTTP/2 prior knowledge, as Envoy's gRPC client
/// speaks it).
pub async fn serve(hub: Arc<Hub>, listener: tokio::net::TcpListener) -> Result<(), String> {
    let keepalive = Some(Duration::from_secs(30));
    streaming::serve(RelayService::new(hub), listener, keepalive).await
}
