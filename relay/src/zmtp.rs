//! A minimal ZMTP 3.0 DEALER client (TCP, NULL security) for vLLM's replay (ROUTER) socket.
//!
//! The zeromq crate's DEALER panics (`todo!()`) when its connection fails mid-receive (e.g. an
//! engine restarting during a replay), and its `connect` retries refused connections with
//! seconds of backoff. The relay probes every engine's replay socket every few tens of ms, so
//! it speaks the few bytes of ZMTP itself: every failure is an `io::Error`, never a panic.
//!
//! Wire (rfc.zeromq.org/spec/23): a 64-byte greeting each way (signature `FF 00.. 01 7F`,
//! version 3.0, mechanism "NULL"), then a READY command each way (property `Socket-Type`),
//! then frames: `flags` (bit 0 MORE, bit 1 LONG, bit 2 COMMAND), a size (1 byte, or 8 bytes
//! big-endian when LONG), the body.

use bytes::Bytes;
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;
/// Larger frames are refused (a vLLM batch is a few KB).
const MAX_FRAME: u64 = 256 << 20;

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// A connected DEALER (one peer). Generic over the byte stream so the fuzz targets can
/// drive it from memory; the relay uses TCP.
pub struct Dealer<S = BufStream<TcpStream>> {
    s: S,
}

impl Dealer {
    /// Connects to `tcp://HOST:PORT` and completes the ZMTP handshake.
    pub async fn connect(endpoint: &str) -> io::Result<Dealer> {
        let addr = endpoint
            .strip_prefix("tcp://")
            .ok_or_else(|| bad(format!("{endpoint}: expected tcp://HOST:PORT")))?;
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        Dealer::handshake(BufStream::new(tcp)).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Dealer<S> {
    /// Completes the ZMTP handshake on a connected (buffered) stream.
    pub async fn handshake(mut s: S) -> io::Result<Dealer<S>> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xFF;
        greeting[8] = 1;
        greeting[9] = 0x7F;
        greeting[10] = 3; // major
        greeting[11] = 0; // minor
        greeting[12..16].copy_from_slice(b"NULL");
        // greeting[32] = 0: as-server false; the rest is filler.
        s.write_all(&greeting).await?;
        let mut ready = Vec::with_capacity(32);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&6u32.to_be_bytes());
        ready.extend_from_slice(b"DEALER");
        write_frame(&mut s, COMMAND, &ready).await?;
        s.flush().await?;
        let mut peer = [0u8; 64];
        s.read_exact(&mut peer).await?;
        if peer[0] != 0xFF || peer[9] & 1 != 1 {
            return Err(bad("the peer does not speak ZMTP"));
        }
        if peer[10] < 3 {
            return Err(bad(format!("the peer speaks ZMTP {}.x, not 3", peer[10])));
        }
        if &peer[12..17] != b"NULL\0" {
            return Err(bad("the peer wants a security mechanism other than NULL"));
        }
        let (flags, body) = read_frame(&mut s).await?;
        let name_len = body.first().copied().unwrap_or(0) as usize;
        let name = body.get(1..1 + name_len).unwrap_or_default();
        if flags & COMMAND == 0 || name != b"READY" {
            return Err(bad(format!(
                "handshake refused: {}",
                String::from_utf8_lossy(&body)
            )));
        }
        Ok(Dealer { s })
    }

    /// Sends one multipart message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        for (i, f) in frames.iter().enumerate() {
            let flags = if i + 1 < frames.len() { MORE } else { 0 };
            write_frame(&mut self.s, flags, f).await?;
        }
        self.s.flush().await
    }

    /// Receives one multipart message (commands such as PING are skipped).
    pub async fn recv(&mut self) -> io::Result<Vec<Bytes>> {
        let mut parts = Vec::new();
        loop {
            let (flags, body) = read_frame(&mut self.s).await?;
            if flags & COMMAND != 0 {
                if parts.is_empty() {
                    continue;
                }
                return Err(bad("a command inside a multipart message"));
            }
            parts.push(Bytes::from(body));
            if flags & MORE == 0 {
                return Ok(parts);
            }
        }
    }

    /// vLLM's replay: sends `["", from]`, returns every `(seq, payload)` up to the END marker
    /// (`seq == -1`).
    pub async fn replay(&mut self, from: u64) -> io::Result<Vec<(u64, Bytes)>> {
        self.send(&[b"", &from.to_be_bytes()]).await?;
        let mut out = Vec::new();
        loop {
            let mut m = self.recv().await?;
            let payload = m.pop().ok_or_else(|| bad("empty replay message"))?;
            let seq = m.pop().ok_or_else(|| bad("malformed replay message"))?;
            let seq: [u8; 8] = seq
                .as_ref()
                .try_into()
                .map_err(|_| bad("malformed replay sequence number"))?;
            let seq = u64::from_be_bytes(seq);
            if seq == u64::MAX {
                return Ok(out);
            }
            out.push((seq, payload));
        }
    }
}

async fn write_frame<S: AsyncWrite + Unpin>(s: &mut S, flags: u8, body: &[u8]) -> io::Result<()> {
    if let Ok(n) = u8::try_from(body.len()) {
        s.write_all(&[flags, n]).await?;
    } else {
        s.write_all(&[flags | LONG]).await?;
        s.write_all(&(body.len() as u64).to_be_bytes()).await?;
    }
    s.write_all(body).await
}

async fn read_frame<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<(u8, Vec<u8>)> {
    let flags = s.read_u8().await?;
    let size = if flags & LONG != 0 {
        s.read_u64().await?
    } else {
        u64::from(s.read_u8().await?)
    };
    if size > MAX_FRAME {
        return Err(bad(format!("frame of {size} bytes")));
    }
    // Grown as bytes arrive: a peer announcing a huge frame and sending little holds little.
    let mut body = Vec::with_capacity(size.min(64 << 10) as usize);
    s.take(size).read_to_end(&mut body).await?;
    if body.len() as u64 != size {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok((flags, body))
}
