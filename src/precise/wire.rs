//! The relay stream's messages (`proto/relay.proto`), derived with prost by hand so neither
//! the filter nor the relay needs protoc to build.

/// gRPC service and method the filter opens and the relay serves.
pub const SERVICE: &str = "kvroute.relay.v1.Relay";
pub const METHOD: &str = "Watch";

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(string, tag = "1")]
    pub gateway: String,
    #[prost(uint32, tag = "2")]
    pub block_size: u32,
    #[prost(bytes = "vec", repeated, tag = "3")]
    pub decisions: Vec<Vec<u8>>,
    #[prost(string, tag = "4")]
    pub group: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Phase {
    Live = 0,
    Snapshot = 1,
    SnapshotEnd = 2,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Update {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(uint64, tag = "2")]
    pub epoch: u64,
    #[prost(enumeration = "Phase", tag = "3")]
    pub phase: i32,
    #[prost(message, repeated, tag = "4")]
    pub workers: Vec<WorkerDelta>,
    #[prost(uint64, tag = "5")]
    pub sent_unix_ns: u64,
    #[prost(message, repeated, tag = "6")]
    pub peers: Vec<PeerDecisions>,
    #[prost(string, repeated, tag = "7")]
    pub gone: Vec<String>,
    #[prost(uint64, tag = "8")]
    pub engine_unix_ns: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PeerDecisions {
    #[prost(string, tag = "1")]
    pub gateway: String,
    #[prost(bytes = "vec", repeated, tag = "2")]
    pub decisions: Vec<Vec<u8>>,
    #[prost(uint64, tag = "3")]
    pub sent_unix_ns: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkerDelta {
    #[prost(string, tag = "1")]
    pub worker: String,
    #[prost(bool, tag = "2")]
    pub cleared: bool,
    #[prost(fixed64, repeated, tag = "3")]
    pub stored: Vec<u64>,
    #[prost(fixed64, repeated, tag = "4")]
    pub removed: Vec<u64>,
    #[prost(bool, tag = "5")]
    pub stale: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// Bytes written by hand from the protobuf encoding rules for relay.proto's field
    /// numbers and types: a renumbered or retyped field fails here.
    #[test]
    fn encoding_matches_the_proto_file() {
        let u = Update {
            seq: 1,
            epoch: 2,
            phase: Phase::SnapshotEnd as i32,
            workers: vec![WorkerDelta {
                worker: "w".into(),
                cleared: true,
                stored: vec![3],
                removed: vec![4],
                stale: true,
            }],
            sent_unix_ns: 5,
            peers: vec![],
            gone: vec![],
            engine_unix_ns: 0,
        };
        let delta: Vec<u8> = [
            &[0x0a, 1, b'w'][..],
            &[0x10, 1],
            &[0x1a, 8, 3, 0, 0, 0, 0, 0, 0, 0],
            &[0x22, 8, 4, 0, 0, 0, 0, 0, 0, 0],
            &[0x28, 1],
        ]
        .concat();
        let mut want = vec![0x08, 1, 0x10, 2, 0x18, 2, 0x22, delta.len() as u8];
        want.extend_from_slice(&delta);
        want.extend_from_slice(&[0x28, 5]);
        assert_eq!(u.encode_to_vec(), want);
        assert_eq!(Update::decode(want.as_slice()).ok(), Some(u));

        let w = WatchRequest {
            gateway: "g".into(),
            block_size: 16,
            decisions: vec![vec![7]],
            group: "x".into(),
        };
        assert_eq!(
            w.encode_to_vec(),
            vec![0x0a, 1, b'g', 0x10, 16, 0x1a, 1, 7, 0x22, 1, b'x']
        );
        let u = Update {
            peers: vec![PeerDecisions {
                gateway: "p".into(),
                decisions: vec![vec![9]],
                sent_unix_ns: 1,
            }],
            gone: vec!["q".into()],
            ..Update::default()
        };
        assert_eq!(
            u.encode_to_vec(),
            vec![0x32, 8, 0x0a, 1, b'p', 0x12, 1, 9, 0x18, 1, 0x3a, 1, b'q']
        );
    }
}
