//! The `kvroute.relay.v1.Relay/Watch` server stream, written by hand on tonic's server
//! machinery (no protoc, no codegen): a snapshot first, then coalesced live deltas.

use crate::hub::{add, now_ns, Change, Hub};
use crate::index::DeltaBuilder;
use kvroute::precise::wire::{Phase, Update, WatchRequest, WorkerDelta, METHOD, SERVICE};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::body::BoxBody;
use tonic::codec::ProstCodec;
use tonic::{Request, Response, Status};

/// Most hashes in one snapshot update.
pub const SNAPSHOT_CHUNK: usize = 32768;
/// A live update is sent once it holds this many hashes (or after `COALESCE`).
pub const LIVE_CHUNK: usize = 4096;
pub const COALESCE: Duration = Duration::from_millis(1);

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

impl tonic::server::NamedService for RelayService {
    const NAME: &'static str = SERVICE;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

struct Watch {
    hub: Arc<Hub>,
}

impl tonic::server::ServerStreamingService<WatchRequest> for Watch {
    type Response = Update;
    type ResponseStream = ReceiverStream<Result<Update, Status>>;
    type Future = BoxFuture<Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: Request<WatchRequest>) -> Self::Future {
        let hub = self.hub.clone();
        Box::pin(async move {
            let req = request.into_inner();
            if req.block_size != hub.block_size {
                return Err(Status::failed_precondition(format!(
                    "block_size mismatch: gateway {:?} hashes blocks of {} tokens, this relay re-keys blocks of {} tokens (set the relay's --block-size or the filter's block_size so they agree)",
                    req.gateway, req.block_size, hub.block_size
                )));
            }
            eprintln!(
                "kvroute-relay: stream opened for {:?} (block_size {})",
                req.gateway, req.block_size
            );
            let (tx, rx) = mpsc::channel(4);
            tokio::spawn(stream_task(hub, req.gateway, tx));
            Ok(Response::new(ReceiverStream::new(rx)))
        })
    }
}

impl<B> tower_service::Service<http::Request<B>> for RelayService
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<BoxBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let hub = self.hub.clone();
        let want = format!("/{SERVICE}/{METHOD}");
        Box::pin(async move {
            if req.uri().path() != want {
                return Ok(
                    Status::unimplemented(format!("unknown method {}", req.uri().path()))
                        .into_http(),
                );
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Update, WatchRequest>::default());
            Ok(grpc.server_streaming(Watch { hub }, req).await)
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
        self.seq += 1;
        let u = Update {
            seq: self.seq,
            epoch: self.hub.epoch,
            phase: phase as i32,
            workers,
            sent_unix_ns: now_ns(),
            ..Update::default()
        };
        if self.tx.send(Ok(u)).await.is_err() {
            return false;
        }
        add(&self.hub.stats.updates_sent, 1);
        true
    }

    /// Subscribes and copies the state under one lock, then sends the snapshot.
    async fn snapshot(&mut self) -> Option<broadcast::Receiver<Arc<Vec<Change>>>> {
        let (rx, parts) = {
            let st = self.hub.lock();
            let rx = st.tx.subscribe();
            let parts: Vec<(String, bool, Vec<u64>)> = st
                .workers
                .iter()
                .map(|w| (w.name.clone(), w.stale, w.index.blocks.snapshot()))
                .collect();
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

fn names(hub: &Hub) -> Vec<String> {
    hub.lock().workers.iter().map(|w| w.name.clone()).collect()
}

async fn stream_task(hub: Arc<Hub>, gateway: String, tx: mpsc::Sender<Result<Update, Status>>) {
    add(&hub.stats.streams_open, 1);
    add(&hub.stats.streams_total, 1);
    let mut s = Stream {
        hub: hub.clone(),
        tx,
        seq: 0,
    };
    live(&mut s).await;
    hub.stats.streams_open.fetch_sub(1, Relaxed);
    eprintln!("kvroute-relay: stream for {gateway:?} closed");
}

async fn live(s: &mut Stream) {
    let Some(mut rx) = s.snapshot().await else {
        return;
    };
    loop {
        // Wait for the first change, then gather what arrives within COALESCE.
        let mut pending: BTreeMap<usize, DeltaBuilder> = BTreeMap::new();
        let mut hashes = 0usize;
        let mut lagged = false;
        let mut closed = false;
        let first = tokio::select! {
            r = rx.recv() => r,
            () = s.tx.closed() => return,
        };
        let mut next = Some(first);
        let deadline = tokio::time::Instant::now() + COALESCE;
        while let Some(r) = next.take() {
            match r {
                Ok(changes) => {
                    for c in changes.iter() {
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
            next = tokio::time::timeout_at(deadline, rx.recv()).await.ok();
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
            if !s.send(Phase::Live, workers).await {
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
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(RelayService::new(hub))
        .serve_with_incoming(incoming)
        .await
        .map_err(|e| e.to_string())
}
