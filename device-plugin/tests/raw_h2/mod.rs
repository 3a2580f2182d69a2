//! A bare HTTP/2 gRPC client over a unix socket that sends `:authority`
//! the way gRPC's C core does for `unix:` targets: the socket path (or its
//! percent-encoding), Huffman-coded and added to the dynamic table on the
//! first call, then referenced by index. Neither hyper nor h2 can send such
//! an authority, hence frames by hand.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use gpupool_device_plugin::transport::authority::PREFACE;
use gpupool_device_plugin::transport::hpack::{Decoder, encode_integer, encode_string};

/// Longest a read on the socket may block.
const WAIT: Duration = Duration::from_secs(15);

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

/// HTTP/2 error code PROTOCOL_ERROR.
pub const PROTOCOL_ERROR: u32 = 0x1;

/// How one call ended.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The first gRPC message of the response, without its 5-byte prefix.
    pub message: Option<Vec<u8>>,
    /// `grpc-status` from the trailers, when the call finished.
    pub grpc_status: Option<String>,
    /// `grpc-message` from the trailers.
    pub grpc_message: Option<String>,
    /// The RST_STREAM error code, when the server reset the stream.
    pub reset: Option<u32>,
}

/// One HTTP/2 connection.
pub struct RawClient {
    socket: UnixStream,
    authority: String,
    authority_indexed: bool,
    decoder: Decoder,
    next_stream: u32,
    block: Vec<u8>,
}

impl RawClient {
    /// Connects and sends the preface; every call will carry `authority`.
    pub fn connect(path: &Path, authority: &str) -> Self {
        let mut socket = UnixStream::connect(path).expect("connect to the plugin socket");
        socket.set_read_timeout(Some(WAIT)).unwrap();
        socket.write_all(PREFACE).unwrap();
        let mut client = RawClient {
            socket,
            authority: authority.to_owned(),
            authority_indexed: false,
            decoder: Decoder::new(),
            next_stream: 1,
            block: Vec::new(),
        };
        client.send(SETTINGS, 0, 0, &[]);
        client
    }

    fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let mut frame = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        frame.push(kind);
        frame.push(flags);
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend_from_slice(payload);
        self.socket.write_all(&frame).unwrap();
    }

    fn read_frame(&mut self) -> Option<(u8, u8, u32, Vec<u8>)> {
        let mut head = [0u8; 9];
        self.socket.read_exact(&mut head).ok()?;
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        self.socket.read_exact(&mut payload).ok()?;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        Some((head[3], head[4], stream, payload))
    }

    fn request_block(&mut self, path: &str) -> Vec<u8> {
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
        encode_integer(&mut block, 4, 0x00, 4); // :path, without indexing
        encode_string(&mut block, path.as_bytes(), false);
        if self.authority_indexed {
            // The only entry this client ever adds: index 62.
            encode_integer(&mut block, 7, 0x80, 62);
        } else {
            encode_integer(&mut block, 6, 0x40, 1); // :authority, incremental indexing
            encode_string(&mut block, self.authority.as_bytes(), true);
            self.authority_indexed = true;
        }
        encode_integer(&mut block, 4, 0x00, 31); // content-type
        encode_string(&mut block, b"application/grpc", true);
        encode_integer(&mut block, 4, 0x00, 0);
        encode_string(&mut block, b"te", false);
        encode_string(&mut block, b"trailers", false);
        block
    }

    /// Sends one unary or server-streaming call and reads until its first
    /// message and trailers arrive, or until `first_message_only` and a
    /// message arrived, or the stream is reset.
    pub fn call(&mut self, path: &str, request: &[u8], first_message_only: bool) -> Outcome {
        let stream = self.next_stream;
        self.next_stream += 2;
        let block = self.request_block(path);
        self.send(HEADERS, END_HEADERS, stream, &block);
        let mut body = vec![0u8];
        body.extend_from_slice(&(request.len() as u32).to_be_bytes());
        body.extend_from_slice(request);
        self.send(DATA, END_STREAM, stream, &body);

        let mut outcome = Outcome::default();
        let mut data = Vec::new();
        loop {
            let Some((kind, flags, id, payload)) = self.read_frame() else {
                panic!("connection closed or silent during {path}: {outcome:?}");
            };
            match kind {
                SETTINGS if flags & ACK == 0 => self.send(SETTINGS, ACK, 0, &[]),
                PING if flags & ACK == 0 => self.send(PING, ACK, 0, &payload),
                GOAWAY => panic!("GOAWAY during {path}: {payload:?}"),
                HEADERS | CONTINUATION => {
                    // Every block is decoded, whichever stream it is on, to
                    // keep the connection's HPACK state.
                    self.block.extend_from_slice(&payload);
                    if flags & END_HEADERS == 0 {
                        continue;
                    }
                    let fields = self
                        .decoder
                        .decode(&self.block)
                        .expect("server headers decode");
                    self.block.clear();
                    if id != stream {
                        continue;
                    }
                    for (name, value) in fields {
                        let value = String::from_utf8_lossy(&value).into_owned();
                        match name.as_slice() {
                            b"grpc-status" => outcome.grpc_status = Some(value),
                            b"grpc-message" => outcome.grpc_message = Some(value),
                            _ => {}
                        }
                    }
                    if flags & END_STREAM != 0 {
                        return outcome;
                    }
                }
                DATA if id == stream => {
                    data.extend_from_slice(&payload);
                    if outcome.message.is_none() && data.len() >= 5 {
                        let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
                        if data.len() >= 5 + len {
                            outcome.message = Some(data[5..5 + len].to_vec());
                            if first_message_only {
                                return outcome;
                            }
                        }
                    }
                }
                RST_STREAM if id == stream => {
                    outcome.reset = Some(u32::from_be_bytes([
                        payload[0], payload[1], payload[2], payload[3],
                    ]));
                    return outcome;
                }
                _ => {}
            }
        }
    }
}

/// Encodes a protobuf message.
pub fn encode<M: prost::Message>(message: &M) -> Vec<u8> {
    message.encode_to_vec()
}

/// Decodes the message of a successful call.
pub fn decode<M: prost::Message + Default>(outcome: &Outcome) -> M {
    let bytes = outcome
        .message
        .as_ref()
        .unwrap_or_else(|| panic!("no response message: {outcome:?}"));
    M::decode(bytes.as_slice()).expect("response decodes")
}
