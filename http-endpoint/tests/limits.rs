//! The endpoint's limits, over real TCP connections: what a peer can hold
//! and for how long.

#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use gpupool_http_endpoint::{Limits, serve};
use http_body_util::Full;
use hyper::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

const REQUEST: &[u8] = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n";

/// The body `/big` answers with.
const BIG_BYTES: usize = 64 << 20;

/// A server answering `pong` under `limits`; dropping the sender stops it.
async fn start(limits: Limits) -> (String, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = oneshot::channel::<()>();
    // Far more than the kernel's socket buffers hold.
    let big = Bytes::from(vec![b'x'; BIG_BYTES]);
    let server = tokio::spawn(serve(
        listener,
        limits,
        move |request| match request.uri().path() {
            "/big" => Response::new(Full::new(big.clone())),
            _ => Response::new(Full::new(Bytes::from_static(b"pong"))),
        },
        async move {
            let _ = stopped.await;
        },
    ));
    (addr, stop, server)
}

/// Reads until one whole `pong` answer has arrived.
async fn read_answer(stream: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).ends_with("pong") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before answering: {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(seen).unwrap()
}

/// Whether the server closes `stream` within `within` (reading nothing).
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(within, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

fn limits() -> Limits {
    Limits {
        max_connections: 2,
        header_timeout: Duration::from_secs(30),
        max_lifetime: Duration::from_secs(60),
        max_header_bytes: 16 << 10,
    }
}

#[tokio::test]
async fn answers_several_requests_on_one_connection() {
    let (addr, _stop, _server) = start(limits()).await;
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    for _ in 0..2 {
        stream.write_all(REQUEST).await.unwrap();
        let answer = read_answer(&mut stream).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    }
}

#[tokio::test]
async fn a_request_head_that_does_not_arrive_in_time_closes_the_connection() {
    let (addr, _stop, _server) = start(Limits {
        header_timeout: Duration::from_millis(200),
        ..limits()
    })
    .await;
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    silent
        .write_all(b"GET /ping HTTP/1.1\r\nHost:")
        .await
        .unwrap();
    assert!(closed_within(&mut silent, Duration::from_secs(10)).await);
    // Likewise a kept-alive connection that goes quiet after an answer.
    let mut idle = TcpStream::connect(&addr).await.unwrap();
    idle.write_all(REQUEST).await.unwrap();
    read_answer(&mut idle).await;
    assert!(closed_within(&mut idle, Duration::from_secs(10)).await);
}

#[tokio::test]
async fn an_oversized_request_head_closes_the_connection() {
    let (addr, _stop, _server) = start(limits()).await;
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    let huge = format!("GET /ping HTTP/1.1\r\nX-Big: {}\r\n", "a".repeat(64 << 10));
    // The server may close while this is still being written.
    let _ = stream.write_all(huge.as_bytes()).await;
    let mut seen = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut seen)).await;
    let text = String::from_utf8_lossy(&seen);
    assert!(read.is_ok(), "the connection stays open: {text}");
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 431"),
        "answered an oversized head: {text}"
    );
}

#[tokio::test]
async fn peers_beyond_the_limit_wait_until_a_connection_ends() {
    let (addr, _stop, _server) = start(limits()).await;
    let mut holders = Vec::new();
    for _ in 0..2 {
        let mut held = TcpStream::connect(&addr).await.unwrap();
        held.write_all(b"GET /ping HTTP/1.1\r\n").await.unwrap();
        holders.push(held);
    }
    // The third peer's connection is made by the kernel but not accepted:
    // its request is not answered while both slots are held.
    let mut waiting = TcpStream::connect(&addr).await.unwrap();
    waiting.write_all(REQUEST).await.unwrap();
    let mut buf = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), waiting.read(&mut buf))
            .await
            .is_err(),
        "answered beyond the connection limit"
    );
    drop(holders.pop());
    let answer = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut waiting))
        .await
        .expect("answered once a slot is free");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
}

#[tokio::test]
async fn a_connection_is_closed_at_its_maximum_lifetime() {
    let (addr, _stop, _server) = start(Limits {
        max_lifetime: Duration::from_millis(300),
        ..limits()
    })
    .await;
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    // Busy enough that the head timeout never fires: a byte every 50 ms.
    let dribble = async {
        for byte in b"GET /ping HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
            if stream.write_all(&[*byte]).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    };
    let cut = tokio::time::timeout(Duration::from_secs(10), dribble).await;
    let closed = match cut {
        Ok(true) => true,
        _ => closed_within(&mut stream, Duration::from_secs(10)).await,
    };
    assert!(closed, "a connection outlived its maximum lifetime");
}

#[tokio::test]
async fn a_peer_that_does_not_take_its_answer_is_cut_off_after_the_lifetime() {
    let (addr, _stop, _server) = start(Limits {
        max_lifetime: Duration::from_millis(300),
        ..limits()
    })
    .await;
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    stream
        .write_all(b"GET /big HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    // Not reading: the answer stalls in the socket buffers, so the graceful
    // shutdown at the lifetime cannot finish, and the grace runs out.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut seen))
        .await
        .expect("the connection was cut")
        .unwrap();
    assert!(
        seen.len() < BIG_BYTES,
        "the whole answer arrived ({} bytes): the connection was not cut",
        seen.len()
    );
}

#[tokio::test]
async fn shutdown_stops_the_server() {
    let (addr, stop, server) = start(limits()).await;
    let mut held = TcpStream::connect(&addr).await.unwrap();
    held.write_all(b"GET /ping HTTP/1.1\r\n").await.unwrap();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returns after shutdown")
        .unwrap();
    assert!(
        closed_within(&mut held, Duration::from_secs(10)).await,
        "open connections are dropped"
    );
    assert!(TcpStream::connect(&addr).await.is_err(), "still accepting");
}
