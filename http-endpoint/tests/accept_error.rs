//! A failed accept does not end the server: with the process out of file
//! descriptors, a waiting peer is answered once one is free again. In a
//! file of its own because it lowers the whole test process's limit.

#![allow(clippy::unwrap_used, missing_docs)]

use std::os::fd::AsRawFd;
use std::time::Duration;

use bytes::Bytes;
use gpupool_http_endpoint::{Limits, serve};
use http_body_util::Full;
use hyper::Response;
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};

/// The lowest descriptor number the process does not use: the kernel
/// hands out the lowest free number, and the limit bounds numbers, so with
/// the limit set to it no new descriptor can be made.
fn lowest_free_fd() -> u64 {
    let probe = std::fs::File::open("/dev/null").unwrap();
    u64::try_from(probe.as_raw_fd()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_outlives_running_out_of_file_descriptors() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(
        listener,
        Limits::default(),
        |_request| Response::new(Full::new(Bytes::from_static(b"pong"))),
        std::future::pending(),
    ));
    // The client's socket exists before the limit drops; the one spare
    // descriptor is what the server gets back later.
    let socket = TcpSocket::new_v4().unwrap();
    let spare = std::fs::File::open("/dev/null").unwrap();
    let before = getrlimit(Resource::Nofile);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(lowest_free_fd()),
            maximum: before.maximum,
        },
    )
    .unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    stream
        .write_all(b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), stream.read(&mut buf))
            .await
            .is_err(),
        "answered although no descriptor was free to accept with"
    );
    drop(spare);
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .expect("answered once a descriptor is free")
        .unwrap();
    setrlimit(Resource::Nofile, before).unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]);
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
}
