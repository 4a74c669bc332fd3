//! The driver's one way to ublkd: its control socket, one request per connection, with
//! the messages `ublkctl` sends (`ublkd_proto::msg::ctl`). This module owns the
//! connection and the reading of ublkd's answers; what the answers mean for a volume is
//! the node service's.
//!
//! Every call blocks (a unix socket, a short answer, except an add or a resize, which
//! wait for a worker): callers run it on a blocking thread.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ublkd_proto::msg::{self, AddRequest, CtlRequest, CtlResponse, DevStatus, MsgError};

/// How long an answer may take: an add waits for its worker to prepare every tag, and a
/// resize for a worker's hand-off (seconds under emulation, as for `ublkctl`).
const ANSWER_WITHIN: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("cannot reach ublkd at {socket}: {source}")]
    Unreachable { socket: PathBuf, source: io::Error },
    #[error("sending the request to ublkd: {0}")]
    Send(MsgError),
    #[error("reading ublkd's answer: {0}")]
    Receive(MsgError),
    /// ublkd refused or failed the request; its message says why.
    #[error("ublkd refused: {0}")]
    Refused(String),
    #[error("ublkd answered {request} with {answer}, which is not an answer to it")]
    Unexpected { request: &'static str, answer: String },
}

/// ublkd's control socket.
#[derive(Debug, Clone)]
pub struct Ctl {
    socket: PathBuf,
}

impl Ctl {
    pub fn new(socket: PathBuf) -> Ctl {
        Ctl { socket }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends one request and returns ublkd's answer; an `Error` answer is
    /// [`CtlError::Refused`].
    pub fn call(&self, request: &CtlRequest) -> Result<CtlResponse, CtlError> {
        let mut stream = UnixStream::connect(&self.socket)
            .map_err(|source| CtlError::Unreachable { socket: self.socket.clone(), source })?;
        let _ = stream.set_read_timeout(Some(ANSWER_WITHIN));
        msg::write_frame(&mut stream, request).map_err(CtlError::Send)?;
        match msg::read_response(&mut stream).map_err(CtlError::Receive)? {
            CtlResponse::Error { message } => Err(CtlError::Refused(message)),
            answer => Ok(answer),
        }
    }

    /// Whether ublkd answers (a listing of its devices).
    pub fn ready(&self) -> Result<(), CtlError> {
        match self.call(&CtlRequest::List { id: None })? {
            CtlResponse::List(_) => Ok(()),
            other => Err(unexpected("list", &other)),
        }
    }

    /// Every device's status.
    pub fn status(&self) -> Result<Vec<DevStatus>, CtlError> {
        match self.call(&CtlRequest::Status { id: None })? {
            CtlResponse::Status(devices) => Ok(devices),
            other => Err(unexpected("status", &other)),
        }
    }

    /// The device named `name`, if ublkd has one (names are unique: ublkd refuses an
    /// add with a name taken).
    pub fn find(&self, name: &str) -> Result<Option<DevStatus>, CtlError> {
        Ok(self.status()?.into_iter().find(|d| d.name.as_deref() == Some(name)))
    }

    /// One device's status, `None` if ublkd has no such device.
    pub fn status_of(&self, id: u32) -> Result<Option<DevStatus>, CtlError> {
        match self.call(&CtlRequest::Status { id: Some(id) }) {
            Ok(CtlResponse::Status(devices)) => Ok(devices.into_iter().find(|d| d.id == id)),
            Ok(other) => Err(unexpected("status", &other)),
            Err(e) => Err(e),
        }
    }

    /// Adds a device; returns its id.
    pub fn add(&self, request: AddRequest) -> Result<u32, CtlError> {
        match self.call(&CtlRequest::Add(request))? {
            CtlResponse::Added { id } => Ok(id),
            other => Err(unexpected("add", &other)),
        }
    }

    /// Deletes device `id`; ublkd refuses, deleting nothing, if its disk is in use.
    pub fn delete(&self, id: u32) -> Result<(), CtlError> {
        match self.call(&CtlRequest::Del { id: Some(id) })? {
            CtlResponse::Deleted { .. } => Ok(()),
            other => Err(unexpected("del", &other)),
        }
    }

    /// Grows device `id` to `size_bytes` while it serves (never shrinks it); returns
    /// the size it serves now.
    pub fn resize(&self, id: u32, size_bytes: u64) -> Result<u64, CtlError> {
        match self.call(&CtlRequest::Resize { id, size_bytes, allow_shrink: false })? {
            CtlResponse::Resized { size_bytes, .. } => Ok(size_bytes),
            other => Err(unexpected("resize", &other)),
        }
    }
}

fn unexpected(request: &'static str, answer: &CtlResponse) -> CtlError {
    // The variant's name is enough to tell what came; the rest may be long.
    let answer = format!("{answer:?}");
    let answer = answer.split([' ', '(', '{']).next().unwrap_or_default().to_string();
    CtlError::Unexpected { request, answer }
}
