//! Accepting any `:authority` on a unix-socket gRPC server.
//!
//! gRPC clients built on gRPC's C core (Python grpcio, and others) and
//! older Go clients (kubelets before 1.26) send the socket path, or its
//! percent-encoding, as the HTTP/2 `:authority` of every call over a unix
//! socket. The `h2` crate under tonic parses `:authority` as a URI
//! authority while decoding the request headers and answers anything else
//! with RST_STREAM(PROTOCOL_ERROR) before tonic sees the call; it has no
//! option to relax that. On a unix socket the authority means nothing, so
//! [`AnyAuthority`] sits between the socket and the HTTP/2 server and
//! rewrites an `:authority` that is not a valid URI authority to
//! `localhost`, leaving everything else as the client sent it.
//!
//! The rewrite happens at the frame level: header blocks (HEADERS and
//! CONTINUATION frames) are HPACK-decoded with the client's compression
//! state and re-encoded without the dynamic table (see
//! [`super::hpack::encode_block`]), so the server's decoder never depends on
//! entries the client thinks it has; every other frame passes through
//! unchanged. Only the client-to-server direction is touched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::codegen::http::uri::Authority;
use tonic::transport::server::Connected;

use super::hpack::{self, Decoder, HpackError};

/// What a client writes first on an HTTP/2 connection (RFC 9113 §3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What an unusable `:authority` becomes.
pub const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Frame payload size every HTTP/2 peer must accept; re-encoded header
/// blocks are cut into frames of at most this size.
const MIN_MAX_FRAME_SIZE: usize = 16_384;
/// Largest header block (all its frames) accepted; a bigger one ends the
/// connection. The server's own header list limit is far lower.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;

/// Why a connection's byte stream could not be rewritten.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum RewriteError {
    /// A header block could not be decoded.
    #[error("undecodable header block: {0}")]
    Hpack(#[from] HpackError),
    /// A header block, or one of its frames, is too large.
    #[error("header block larger than {MAX_HEADER_BLOCK} bytes")]
    TooLarge,
    /// Frames that break HTTP/2's rules for header blocks.
    #[error("HTTP/2 protocol error: {0}")]
    Protocol(&'static str),
}

impl From<RewriteError> for io::Error {
    fn from(error: RewriteError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, error)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the client preface.
    Preface,
    /// Reading frames.
    Frames,
    /// Not HTTP/2 with prior knowledge: bytes pass unchanged (the server
    /// will refuse them itself).
    Passthrough,
}

/// A header block being collected from a HEADERS frame and its
/// CONTINUATION frames.
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The byte-stream rewriter, without I/O: bytes the client sent go in with
/// [`Rewriter::feed`], bytes for the server come out of [`Rewriter::output`].
pub struct Rewriter {
    phase: Phase,
    /// Received bytes not yet processed (an incomplete frame).
    input: Vec<u8>,
    /// Processed bytes not yet handed to the server.
    output: Vec<u8>,
    output_pos: usize,
    /// Payload bytes of a passing frame still to forward.
    passing: usize,
    pending: Option<PendingBlock>,
    decoder: Decoder,
    rewrites: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Rewriter::new()
    }
}

impl Rewriter {
    /// A rewriter at the start of a connection.
    pub fn new() -> Self {
        Rewriter {
            phase: Phase::Preface,
            input: Vec::new(),
            output: Vec::new(),
            output_pos: 0,
            passing: 0,
            pending: None,
            decoder: Decoder::new(),
            rewrites: 0,
        }
    }

    /// How many `:authority` values were replaced so far.
    pub fn rewrites(&self) -> u64 {
        self.rewrites
    }

    /// Takes bytes the client sent and processes every complete frame.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), RewriteError> {
        self.input.extend_from_slice(bytes);
        self.process()
    }

    /// The client closed its side: whatever incomplete frame is left goes
    /// to the server as it is, for the server to reject.
    pub fn finish(&mut self) {
        self.output.append(&mut self.input);
    }

    /// Bytes ready for the server.
    pub fn output(&self) -> &[u8] {
        &self.output[self.output_pos..]
    }

    /// Marks `n` bytes of [`Rewriter::output`] as handed on.
    pub fn consume(&mut self, n: usize) {
        self.output_pos = (self.output_pos + n).min(self.output.len());
        if self.output_pos == self.output.len() {
            self.output.clear();
            self.output_pos = 0;
        }
    }

    fn process(&mut self) -> Result<(), RewriteError> {
        loop {
            match self.phase {
                Phase::Passthrough => {
                    self.output.append(&mut self.input);
                    return Ok(());
                }
                Phase::Preface => {
                    let seen = self.input.len().min(PREFACE.len());
                    if self.input[..seen] != PREFACE[..seen] {
                        self.phase = Phase::Passthrough;
                        continue;
                    }
                    if seen < PREFACE.len() {
                        return Ok(());
                    }
                    self.output.extend(self.input.drain(..PREFACE.len()));
                    self.phase = Phase::Frames;
                }
                Phase::Frames => {
                    if self.passing > 0 {
                        let n = self.passing.min(self.input.len());
                        if n == 0 {
                            return Ok(());
                        }
                        self.output.extend(self.input.drain(..n));
                        self.passing -= n;
                        continue;
                    }
                    if self.input.len() < FRAME_HEADER_LEN {
                        return Ok(());
                    }
                    let len = usize::from(self.input[0]) << 16
                        | usize::from(self.input[1]) << 8
                        | usize::from(self.input[2]);
                    let kind = self.input[3];
                    if self.pending.is_some() && kind != CONTINUATION {
                        return Err(RewriteError::Protocol(
                            "a header block is interrupted by another frame",
                        ));
                    }
                    if kind != HEADERS && kind != CONTINUATION {
                        self.output.extend(self.input.drain(..FRAME_HEADER_LEN));
                        self.passing = len;
                        continue;
                    }
                    if len > MAX_HEADER_BLOCK {
                        return Err(RewriteError::TooLarge);
                    }
                    if self.input.len() < FRAME_HEADER_LEN + len {
                        return Ok(());
                    }
                    let frame: Vec<u8> = self.input.drain(..FRAME_HEADER_LEN + len).collect();
                    self.header_frame(&frame)?;
                }
            }
        }
    }

    fn header_frame(&mut self, frame: &[u8]) -> Result<(), RewriteError> {
        let kind = frame[3];
        let flags = frame[4];
        let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let mut payload = &frame[FRAME_HEADER_LEN..];
        if kind == CONTINUATION {
            let Some(pending) = self.pending.as_mut() else {
                return Err(RewriteError::Protocol("CONTINUATION without HEADERS"));
            };
            if pending.stream_id != stream_id {
                return Err(RewriteError::Protocol("CONTINUATION on another stream"));
            }
            if pending.fragment.len() + payload.len() > MAX_HEADER_BLOCK {
                return Err(RewriteError::TooLarge);
            }
            pending.fragment.extend_from_slice(payload);
        } else {
            if flags & PADDED != 0 {
                let (&pad, rest) = payload.split_first().ok_or(RewriteError::Protocol(
                    "PADDED HEADERS without a pad length",
                ))?;
                let keep = rest
                    .len()
                    .checked_sub(usize::from(pad))
                    .ok_or(RewriteError::Protocol("padding longer than the frame"))?;
                payload = &rest[..keep];
            }
            let priority = if flags & PRIORITY != 0 {
                let (fields, rest) = payload
                    .split_first_chunk::<5>()
                    .ok_or(RewriteError::Protocol("PRIORITY HEADERS too short"))?;
                payload = rest;
                Some(*fields)
            } else {
                None
            };
            self.pending = Some(PendingBlock {
                stream_id,
                end_stream: flags & END_STREAM != 0,
                priority,
                fragment: payload.to_vec(),
            });
        }
        if flags & END_HEADERS != 0
            && let Some(block) = self.pending.take()
        {
            self.rewrite_block(block)?;
        }
        Ok(())
    }

    fn rewrite_block(&mut self, block: PendingBlock) -> Result<(), RewriteError> {
        let mut fields = self.decoder.decode(&block.fragment)?;
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority" && Authority::try_from(value.as_slice()).is_err() {
                if self.rewrites == 0 {
                    tracing::debug!(
                        authority = %String::from_utf8_lossy(value),
                        "client sent an :authority that is not a host (gRPC's C core sends the socket path); serving it as localhost"
                    );
                }
                self.rewrites += 1;
                *value = REPLACEMENT_AUTHORITY.to_vec();
            }
        }
        let encoded = hpack::encode_block(&fields);
        let priority: &[u8] = block.priority.as_ref().map_or(&[], |p| p.as_slice());
        let first_room = MIN_MAX_FRAME_SIZE - priority.len();
        let (first, mut rest) = encoded.split_at(encoded.len().min(first_room));
        let mut flags = if block.end_stream { END_STREAM } else { 0 };
        if block.priority.is_some() {
            flags |= PRIORITY;
        }
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        self.write_frame(HEADERS, flags, block.stream_id, &[priority, first]);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MIN_MAX_FRAME_SIZE));
            rest = tail;
            let flags = if rest.is_empty() { END_HEADERS } else { 0 };
            self.write_frame(CONTINUATION, flags, block.stream_id, &[chunk]);
        }
        Ok(())
    }

    fn write_frame(&mut self, kind: u8, flags: u8, stream_id: u32, parts: &[&[u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        // Both callers keep `len` within MIN_MAX_FRAME_SIZE, far below 2^24.
        self.output
            .extend_from_slice(&(len as u32).to_be_bytes()[1..]);
        self.output.push(kind);
        self.output.push(flags);
        self.output.extend_from_slice(&stream_id.to_be_bytes());
        for part in parts {
            self.output.extend_from_slice(part);
        }
    }
}

/// A server-side connection that accepts any `:authority` (see the module
/// documentation); writes pass through untouched.
pub struct AnyAuthority<S> {
    inner: S,
    rewriter: Rewriter,
    eof: bool,
}

impl<S> AnyAuthority<S> {
    /// Wraps a freshly accepted connection, before any byte was read.
    pub fn new(inner: S) -> Self {
        AnyAuthority {
            inner,
            rewriter: Rewriter::new(),
            eof: false,
        }
    }
}

/// Bytes read from the socket per call.
const READ_CHUNK: usize = 8 * 1024;

impl<S: AsyncRead + Unpin> AsyncRead for AnyAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let ready = this.rewriter.output();
            if !ready.is_empty() {
                let n = ready.len().min(buf.remaining());
                buf.put_slice(&ready[..n]);
                this.rewriter.consume(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; READ_CHUNK];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                this.rewriter.finish();
                continue;
            }
            if let Err(e) = this.rewriter.feed(read.filled()) {
                tracing::warn!(error = %e, "closing a gRPC connection whose header frames cannot be read");
                return Poll::Ready(Err(e.into()));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AnyAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: Connected> Connected for AnyAuthority<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::hpack::{encode_integer, encode_string};

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        out.push(kind);
        out.push(flags);
        out.extend_from_slice(&stream_id.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Splits the rewriter's output into (kind, flags, stream, payload).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len =
                usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            out.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        out
    }

    /// A request block as gRPC's C core might send it: the path authority
    /// Huffman-coded and added to the dynamic table.
    fn c_core_block(authority: &str) -> Vec<u8> {
        let mut block = vec![0x83, 0x86];
        encode_integer(&mut block, 6, 0x40, 4);
        encode_string(&mut block, b"/v1beta1.DevicePlugin/Allocate", true);
        encode_integer(&mut block, 6, 0x40, 1);
        encode_string(&mut block, authority.as_bytes(), true);
        encode_integer(&mut block, 6, 0x40, 0);
        encode_string(&mut block, b"te", false);
        encode_string(&mut block, b"trailers", false);
        block
    }

    fn run(input: &[u8], chunk: usize) -> Result<(Vec<u8>, u64), RewriteError> {
        let mut rewriter = Rewriter::new();
        let mut out = Vec::new();
        for piece in input.chunks(chunk.max(1)) {
            rewriter.feed(piece)?;
            out.extend_from_slice(rewriter.output());
            let n = rewriter.output().len();
            rewriter.consume(n);
        }
        rewriter.finish();
        out.extend_from_slice(rewriter.output());
        Ok((out, rewriter.rewrites()))
    }

    fn decode_all(frames: &[(u8, u8, u32, Vec<u8>)]) -> Vec<Vec<hpack::Field>> {
        let mut decoder = Decoder::new();
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        for (kind, flags, _, payload) in frames {
            if *kind == HEADERS || *kind == CONTINUATION {
                let mut payload = payload.as_slice();
                if *kind == HEADERS && flags & PRIORITY != 0 {
                    payload = &payload[5..];
                }
                block.extend_from_slice(payload);
                if flags & END_HEADERS != 0 {
                    blocks.push(decoder.decode(&block).expect("decodable"));
                    block.clear();
                }
            }
        }
        blocks
    }

    fn authority(fields: &[hpack::Field]) -> Option<String> {
        fields
            .iter()
            .find(|(n, _)| n == b":authority")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    #[test]
    fn rewrites_path_authorities_and_keeps_valid_ones() {
        let cases = [
            (
                "/var/lib/kubelet/device-plugins/gpupool.sock",
                "localhost",
                1,
            ),
            (
                "%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fgpupool.sock",
                "localhost",
                1,
            ),
            ("unix:%2Frun%2Fx.sock", "localhost", 1),
            ("localhost", "localhost", 0),
            ("[::1]:50051", "[::1]:50051", 0),
            ("gpupool.example:443", "gpupool.example:443", 0),
        ];
        for (sent, served, rewrites) in cases {
            let mut input = PREFACE.to_vec();
            input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
            input.extend(frame(HEADERS, END_HEADERS, 1, &c_core_block(sent)));
            input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0"));
            // The same request again, by dynamic-table indices (newest
            // first: te at 62, the authority at 63, the path at 64).
            input.extend(frame(
                HEADERS,
                END_HEADERS | END_STREAM,
                3,
                &[0x83, 0x86, 0xc0, 0xbf, 0xbe],
            ));
            for chunk in [1, 7, 4096] {
                let (out, count) = run(&input, chunk).expect("rewrites");
                assert_eq!(&out[..24], PREFACE);
                let frames = frames(&out[24..]);
                let kinds: Vec<u8> = frames.iter().map(|f| f.0).collect();
                assert_eq!(kinds, vec![0x4, HEADERS, 0x0, HEADERS], "{sent}");
                assert_eq!(frames[2].3, b"\0\0\0\0\0", "DATA passes unchanged");
                assert_eq!(frames[3].1, END_HEADERS | END_STREAM, "flags kept");
                let blocks = decode_all(&frames);
                assert_eq!(authority(&blocks[0]).as_deref(), Some(served), "{sent}");
                assert_eq!(authority(&blocks[1]).as_deref(), Some(served), "{sent}");
                assert_eq!(blocks[0][2].1, b"/v1beta1.DevicePlugin/Allocate");
                assert_eq!(blocks[0].len(), 5);
                assert_eq!(count, rewrites * 2, "{sent}");
            }
        }
    }

    #[test]
    fn padding_priority_and_continuation_are_handled() {
        let block = c_core_block("/run/x.sock");
        let (head, tail) = block.split_at(10);
        let mut payload = vec![3]; // pad length
        payload.extend_from_slice(&[0x80, 0, 0, 1, 16]); // priority
        payload.extend_from_slice(head);
        payload.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &payload));
        input.extend(frame(CONTINUATION, END_HEADERS, 5, tail));
        let (out, count) = run(&input, 3).expect("rewrites");
        assert_eq!(count, 1);
        let frames = frames(&out[24..]);
        assert_eq!(frames.len(), 1, "one HEADERS frame suffices");
        assert_eq!(frames[0].1, PRIORITY | END_STREAM | END_HEADERS);
        assert_eq!(&frames[0].3[..5], &[0x80, 0, 0, 1, 16]);
        assert_eq!(
            authority(&decode_all(&frames)[0]).as_deref(),
            Some("localhost")
        );
    }

    #[test]
    fn large_blocks_are_cut_into_continuations() {
        let mut fields = hpack::encode_block(&[(b":authority".to_vec(), b"/x.sock".to_vec())]);
        for i in 0..40 {
            fields.extend(hpack::encode_block(&[(
                format!("x-{i}").into_bytes(),
                vec![b'v'; 1000],
            )]));
        }
        let mut input = PREFACE.to_vec();
        let (head, rest) = fields.split_at(MIN_MAX_FRAME_SIZE);
        input.extend(frame(HEADERS, 0, 1, head));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, rest));
        let (out, _) = run(&input, 10_000).expect("rewrites");
        let frames = frames(&out[24..]);
        assert!(frames.len() >= 3, "{}", frames.len());
        assert!(frames.iter().all(|f| f.3.len() <= MIN_MAX_FRAME_SIZE));
        assert_eq!(frames[0].0, HEADERS);
        assert!(frames[1..].iter().all(|f| f.0 == CONTINUATION));
        let blocks = decode_all(&frames);
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].len(), 41);
        assert_eq!(authority(&blocks[0]).as_deref(), Some("localhost"));
    }

    #[test]
    fn not_http2_passes_through() {
        let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let (out, count) = run(input, 5).expect("passes");
        assert_eq!(out, input);
        assert_eq!(count, 0);
    }

    #[test]
    fn broken_header_frames_are_errors() {
        let with_preface = |frames: &[Vec<u8>]| {
            let mut input = PREFACE.to_vec();
            for f in frames {
                input.extend_from_slice(f);
            }
            input
        };
        let cases = [
            (
                with_preface(&[frame(HEADERS, END_HEADERS, 1, &[0x80])]),
                RewriteError::Hpack(HpackError::BadIndex(0)),
            ),
            (
                with_preface(&[frame(CONTINUATION, END_HEADERS, 1, &[0x82])]),
                RewriteError::Protocol("CONTINUATION without HEADERS"),
            ),
            (
                with_preface(&[
                    frame(HEADERS, 0, 1, &[0x82]),
                    frame(CONTINUATION, END_HEADERS, 3, &[0x84]),
                ]),
                RewriteError::Protocol("CONTINUATION on another stream"),
            ),
            (
                with_preface(&[frame(HEADERS, 0, 1, &[0x82]), frame(0x0, 0, 1, b"x")]),
                RewriteError::Protocol("a header block is interrupted by another frame"),
            ),
            (
                with_preface(&[frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x82])]),
                RewriteError::Protocol("padding longer than the frame"),
            ),
            (
                with_preface(&[frame(HEADERS, PRIORITY | END_HEADERS, 1, &[0, 0])]),
                RewriteError::Protocol("PRIORITY HEADERS too short"),
            ),
        ];
        for (input, want) in cases {
            assert_eq!(run(&input, 4096).map(|_| ()), Err(want.clone()), "{want}");
        }
        let mut huge = PREFACE.to_vec();
        huge.extend_from_slice(&[0x20, 0, 0, HEADERS, 0, 0, 0, 0, 1]);
        assert_eq!(run(&huge, 4096).map(|_| ()), Err(RewriteError::TooLarge));
    }
}
