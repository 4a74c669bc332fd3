//! A client for the driver's own socket: what a test (playing the kubelet) or a health
//! check uses to call the services over a unix socket.

use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// Connects to the driver listening on the unix socket `path`.
pub async fn connect(path: impl Into<PathBuf>) -> Result<Channel, tonic::transport::Error> {
    let path = path.into();
    // The URI is required by the API and unused: the connector below dials the socket.
    Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}
