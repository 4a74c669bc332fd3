//! A hostile NBD peer for the kernel tests: a proxy in front of a real NBD server
//! (nbdkit) that forwards one connection at a time, and accepts a connection made
//! while another is forwarded (after a second's grace for that one to end) but never
//! answers it, as a server at its connection limit, or behind a broken balancer, would.
//! Over TCP or a unix socket (what the systemd unit lets ublkd reach).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Where the proxy listens, or its server does.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// 127.0.0.1 at this port.
    Tcp(u16),
    Unix(PathBuf),
}

/// The running proxy (its threads live as long as the test process).
#[derive(Debug)]
pub struct OneAtATimeProxy {
    /// The NBD URI that reaches the proxy.
    pub uri: String,
    silent: Arc<AtomicUsize>,
}

impl OneAtATimeProxy {
    /// Listens at `listen`, forwarding to the server at `server`.
    pub fn start(listen: Endpoint, server: Endpoint) -> OneAtATimeProxy {
        let silent = Arc::new(AtomicUsize::new(0));
        let held = Arc::clone(&silent);
        let uri = match &listen {
            Endpoint::Tcp(port) => format!("nbd://127.0.0.1:{port}"),
            Endpoint::Unix(path) => format!("nbd+unix:///?socket={}", path.display()),
        };
        match listen {
            Endpoint::Tcp(port) => {
                let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
                std::thread::spawn(move || serve(listener.incoming().flatten(), server, held));
            }
            Endpoint::Unix(path) => {
                let _ = std::fs::remove_file(&path);
                let listener = UnixListener::bind(&path).unwrap();
                std::thread::spawn(move || serve(listener.incoming().flatten(), server, held));
            }
        }
        OneAtATimeProxy { uri, silent }
    }

    /// How many connections it left unanswered so far.
    pub fn silent(&self) -> usize {
        self.silent.load(Ordering::SeqCst)
    }
}

/// A connection either way, for the proxy's copying threads.
trait Duplex: Read + Write + Send + Sized + 'static {
    fn dup(&self) -> std::io::Result<Self>;
    fn end(&self, how: Shutdown);
}

impl Duplex for TcpStream {
    fn dup(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn end(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

impl Duplex for UnixStream {
    fn dup(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn end(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

fn serve<S: Duplex>(clients: impl Iterator<Item = S>, server: Endpoint, silent: Arc<AtomicUsize>) {
    let forwarded = Arc::new(AtomicUsize::new(0));
    for client in clients {
        let free_by = Instant::now() + Duration::from_secs(1);
        while forwarded.load(Ordering::SeqCst) > 0 && Instant::now() < free_by {
            std::thread::sleep(Duration::from_millis(10));
        }
        if forwarded.load(Ordering::SeqCst) > 0 {
            silent.fetch_add(1, Ordering::SeqCst);
            // Read and drop whatever comes, answer nothing, until the client goes.
            std::thread::spawn(move || {
                let mut client = client;
                let _ = std::io::copy(&mut client, &mut std::io::sink());
            });
            continue;
        }
        match &server {
            Endpoint::Tcp(port) => match TcpStream::connect(("127.0.0.1", *port)) {
                Ok(upstream) => forward_mixed(client, upstream, &forwarded),
                Err(_) => continue,
            },
            Endpoint::Unix(path) => match UnixStream::connect(path) {
                Ok(upstream) => forward_mixed(client, upstream, &forwarded),
                Err(_) => continue,
            },
        }
    }
}

/// Copies both ways between `client` and `upstream` on two threads; the connection
/// counts as forwarded until both directions have ended.
fn forward_mixed<A: Duplex, B: Duplex>(client: A, upstream: B, forwarded: &Arc<AtomicUsize>) {
    let (Ok(client_copy), Ok(upstream_copy)) = (client.dup(), upstream.dup()) else { return };
    forwarded.fetch_add(1, Ordering::SeqCst);
    let ends = Arc::new(AtomicUsize::new(2));
    let done = {
        let (ends, forwarded) = (Arc::clone(&ends), Arc::clone(forwarded));
        move || {
            if ends.fetch_sub(1, Ordering::SeqCst) == 1 {
                forwarded.fetch_sub(1, Ordering::SeqCst);
            }
        }
    };
    pump(client, upstream, done.clone());
    pump(upstream_copy, client_copy, done);
}

/// Copies `from` into `to` on a thread of its own until `from` ends, then ends both
/// halves and calls `done`.
fn pump<R: Duplex, W: Duplex>(mut from: R, mut to: W, done: impl FnOnce() + Send + 'static) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        to.end(Shutdown::Write);
        from.end(Shutdown::Read);
        done();
    });
}
