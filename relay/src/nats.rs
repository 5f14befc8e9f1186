//! The NATS side of decision sharing (`--nats`): the connection, the publisher that batches
//! local decisions per group, the subscriber that hands other relays' messages to `Share`,
//! and the reaper of silent peers.

use crate::counter::add;
use crate::share::{subject, Out, Share, ShareMsg, HEARTBEAT};
use kvroute::precise::wire::PeerDecisions;
use prost::Message as _;
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;

/// Local decisions queued for the NATS publisher.
pub const OUT_QUEUE: usize = 65536;
/// A batch is published as soon as no more decisions are queued, or once its decisions
/// reach this many bytes.
pub const FLUSH_BYTES: usize = 64 * 1024;
/// Default `--nats-subject-prefix`.
pub const SUBJECT_PREFIX: &str = "kvroute.decisions";

/// `--nats` and friends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsOpts {
    pub url: String,
    pub prefix: String,
    pub peer_timeout: Duration,
}

/// `--nats-user` and its password. Debug does not print the password.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsCreds {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for NatsCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NatsCreds({:?}, password hidden)", self.user)
    }
}

/// The URL as logged: credentials in it (nats://user:pass@host) are not.
fn shown_url(url: &str) -> String {
    match url.split_once("://").and_then(|(s, rest)| {
        let (userinfo, host) = rest.rsplit_once('@')?;
        (!userinfo.is_empty()).then(|| format!("{s}://***@{host}"))
    }) {
        Some(u) => u,
        None => url.to_owned(),
    }
}

/// Logs the connection's changes once each and counts its errors.
fn on_event(share: &Share, ev: &async_nats::Event) {
    match ev {
        async_nats::Event::Connected => {
            if !share.stats.nats_connected.swap(true, Relaxed) {
                if share.lost.load(Relaxed) {
                    eprintln!("kvroute-relay: NATS connection recovered; sharing resumes");
                } else {
                    eprintln!("kvroute-relay: connected to NATS");
                }
            }
        }
        async_nats::Event::Disconnected => {
            add(&share.stats.nats_errors, 1);
            if share.stats.nats_connected.swap(false, Relaxed) {
                share.lost.store(true, Relaxed);
                eprintln!(
                    "kvroute-relay: NATS connection lost; reconnecting (decisions are not shared meanwhile, peers become gone after the peer timeout)"
                );
            }
        }
        async_nats::Event::ClientError(e) => {
            add(&share.stats.nats_errors, 1);
            // Never connected yet: say so once (later losses are logged on Disconnected).
            if !share.stats.nats_connected.load(Relaxed) && !share.lost.swap(true, Relaxed) {
                eprintln!("kvroute-relay: NATS not reachable ({e}); retrying (decisions are not shared meanwhile)");
            }
        }
        async_nats::Event::Closed
        | async_nats::Event::SlowConsumer(_)
        | async_nats::Event::ServerError(_) => add(&share.stats.nats_errors, 1),
        async_nats::Event::LameDuckMode | async_nats::Event::Draining => {}
    }
}

/// Connects to NATS (in the background: the relay starts even when NATS is down; the client
/// reconnects by itself) and starts the publisher, the subscriber and the peer reaper.
pub async fn start_nats(share: Arc<Share>, opts: NatsOpts) -> Result<(), String> {
    start_nats_as(share, opts, None).await
}

/// `start_nats`, connecting as `creds` (NATS user and password) when given.
pub async fn start_nats_as(
    share: Arc<Share>,
    opts: NatsOpts,
    creds: Option<NatsCreds>,
) -> Result<(), String> {
    let shown = shown_url(&opts.url);
    share
        .peer_timeout_ms
        .store(opts.peer_timeout.as_millis() as u64, Relaxed);
    if opts.peer_timeout < 2 * HEARTBEAT {
        eprintln!(
            "kvroute-relay: warning: --peer-timeout-ms {} is under two heartbeats ({} ms): live peers may be announced gone",
            opts.peer_timeout.as_millis(),
            (2 * HEARTBEAT).as_millis()
        );
    }
    let (tx, rx) = mpsc::channel(OUT_QUEUE);
    if share.out.set(tx).is_err() {
        return Err("NATS sharing started twice".to_owned());
    }
    let s = share.clone();
    let mut connect = async_nats::ConnectOptions::new();
    if let Some(c) = creds {
        connect = connect.user_and_password(c.user, c.password);
    }
    let client = connect
        .name("kvroute-relay")
        .no_echo()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((50 * attempts as u64).clamp(50, 1000))
        })
        .event_callback(move |ev| {
            on_event(&s, &ev);
            async {}
        })
        .connect(opts.url.as_str())
        .await
        .map_err(|e| format!("--nats {shown}: {e}"))?;
    let wildcard = format!("{}.*", opts.prefix);
    let sub = client
        .subscribe(wildcard.clone())
        .await
        .map_err(|e| format!("--nats {shown}: subscribe {wildcard}: {e}"))?;
    eprintln!(
        "kvroute-relay: sharing decisions over NATS {shown} (subjects {wildcard}, relay id {:016x}, peer timeout {} ms)",
        share.relay_id,
        opts.peer_timeout.as_millis()
    );
    tokio::spawn(publisher(share.clone(), client, opts.prefix, rx));
    tokio::spawn(receiver(share.clone(), sub));
    tokio::spawn(reaper(share, opts.peer_timeout));
    Ok(())
}

async fn receiver(share: Arc<Share>, mut sub: async_nats::Subscriber) {
    while let Some(m) = sub.next().await {
        match ShareMsg::decode(m.payload) {
            Ok(msg) => share.on_remote(msg),
            Err(_) => add(&share.stats.bad_messages, 1),
        }
    }
}

async fn reaper(share: Arc<Share>, timeout: Duration) {
    let mut t = tokio::time::interval(
        (timeout / 10).clamp(Duration::from_millis(10), Duration::from_millis(100)),
    );
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        t.tick().await;
        share.reap();
    }
}

#[derive(Default)]
struct Batch {
    peers: Vec<PeerDecisions>,
    by_gateway: HashMap<String, usize>,
    bytes: usize,
    gone: Vec<String>,
}

async fn publisher(
    share: Arc<Share>,
    client: async_nats::Client,
    prefix: String,
    mut rx: mpsc::Receiver<Out>,
) {
    let mut batches: HashMap<String, Batch> = HashMap::new();
    let mut hb = tokio::time::interval(HEARTBEAT);
    hb.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            m = rx.recv() => {
                let Some(m) = m else { return };
                // Take what is already queued too, then publish at once: no timer (a 1 ms
                // window cost 1-2 ms on tokio's timer wheel); under load the decisions that
                // queued during the previous publish go out together.
                let mut next = Some(m);
                while let Some(m) = next.take() {
                    if let Some((group, b)) = absorb(&mut batches, m) {
                        flush(&share, &client, &prefix, group, b).await;
                    }
                    next = rx.try_recv().ok();
                }
                for (group, b) in std::mem::take(&mut batches) {
                    flush(&share, &client, &prefix, group, b).await;
                }
            }
            _ = hb.tick() => {
                if !share.stats.nats_connected.load(Relaxed) {
                    continue;
                }
                for (group, alive) in share.local_groups() {
                    let msg = ShareMsg { relay: share.relay_id, alive, ..ShareMsg::default() };
                    let msg = ShareMsg { group, ..msg };
                    publish(&share, &client, &prefix, &msg).await;
                }
            }
        }
    }
}

/// Adds one outgoing message to its group's batch; returns a batch that must go out now (a
/// gateway gone, or the batch is full).
fn absorb(batches: &mut HashMap<String, Batch>, m: Out) -> Option<(String, Batch)> {
    match m {
        Out::Decisions {
            group,
            gateway,
            decisions,
            at_ns,
        } => {
            let b = batches.entry(group.clone()).or_default();
            b.bytes += decisions.iter().map(|d| d.len() + 4).sum::<usize>();
            match b.by_gateway.get(&gateway) {
                Some(&i) => {
                    if let Some(p) = b.peers.get_mut(i) {
                        p.decisions.extend(decisions);
                    }
                }
                None => {
                    b.bytes += gateway.len() + 16;
                    b.by_gateway.insert(gateway.clone(), b.peers.len());
                    b.peers.push(PeerDecisions {
                        gateway,
                        decisions,
                        sent_unix_ns: at_ns,
                    });
                }
            }
            if b.bytes >= FLUSH_BYTES {
                return batches.remove(&group).map(|b| (group, b));
            }
            None
        }
        Out::Gone { group, gateway } => {
            // Published at once (with whatever decisions precede it).
            let mut b = batches.remove(&group).unwrap_or_default();
            b.gone.push(gateway);
            Some((group, b))
        }
    }
}

async fn flush(share: &Share, client: &async_nats::Client, prefix: &str, group: String, b: Batch) {
    let n: u64 = b.peers.iter().map(|p| p.decisions.len() as u64).sum();
    if !share.stats.nats_connected.load(Relaxed) {
        add(&share.stats.dropped_nats, n);
        return;
    }
    let msg = ShareMsg {
        relay: share.relay_id,
        group,
        peers: b.peers,
        alive: Vec::new(),
        gone: b.gone,
    };
    if publish(share, client, prefix, &msg).await {
        add(&share.stats.published, n);
    } else {
        add(&share.stats.dropped_nats, n);
    }
}

async fn publish(share: &Share, client: &async_nats::Client, prefix: &str, msg: &ShareMsg) -> bool {
    let subject = subject(prefix, &msg.group);
    match client.publish(subject, msg.encode_to_vec().into()).await {
        Ok(()) => {
            add(&share.stats.messages_published, 1);
            true
        }
        Err(_) => {
            add(&share.stats.nats_errors, 1);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_stay_out_of_logs() {
        assert_eq!(shown_url("nats://u:p@h:4222"), "nats://***@h:4222");
        assert_eq!(shown_url("nats://h:4222"), "nats://h:4222");
        let c = NatsCreds {
            user: "relay".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
