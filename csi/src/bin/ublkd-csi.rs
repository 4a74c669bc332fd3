//! `ublkd-csi`: the CSI node plugin. Serves the Identity and Node services on a unix
//! socket (the kubelet's, through node-driver-registrar) and drives ublkd on its own.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Parser;
use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use ublkd_csi::csi::identity_server::IdentityServer;
use ublkd_csi::csi::node_server::NodeServer;
use ublkd_csi::ctl::Ctl;
use ublkd_csi::identity::IdentityService;
use ublkd_csi::node::NodeService;

#[derive(Debug, Parser)]
#[command(version, about = "A Kubernetes CSI node plugin whose volumes are ublkd's devices")]
struct Cli {
    /// The unix socket to serve CSI on (a path, or `unix://PATH` as the sidecars write
    /// it); a stale socket there is replaced.
    #[arg(long, default_value = "/var/lib/kubelet/plugins/ublk.csi.ublkd.io/csi.sock")]
    endpoint: String,
    /// ublkd's control socket.
    #[arg(long, default_value = "/run/ublkd/ublkd.sock")]
    ublkd_socket: PathBuf,
    /// This node's id, as NodeGetInfo reports it (default: the host name).
    #[arg(long)]
    node_id: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("UBLKD_CSI_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let node_id = match cli.node_id {
        Some(id) => id,
        None => nix::unistd::gethostname()
            .context("cannot read the host name; give --node-id")?
            .to_string_lossy()
            .into_owned(),
    };
    let endpoint = PathBuf::from(cli.endpoint.strip_prefix("unix://").unwrap_or(&cli.endpoint));
    // Blocking work (ublkd's requests, mkfs, mount) runs on tokio's blocking threads;
    // one thread is enough for the gRPC side.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(&endpoint, Ctl::new(cli.ublkd_socket), node_id))
}

async fn serve(endpoint: &Path, ctl: Ctl, node_id: String) -> anyhow::Result<()> {
    remove_stale(endpoint)?;
    if let Some(dir) = endpoint.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let listener = UnixListener::bind(endpoint)
        .with_context(|| format!("cannot listen on {}", endpoint.display()))?;
    // The socket stages and mounts disks: root's only.
    std::fs::set_permissions(endpoint, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", endpoint.display()))?;
    tracing::info!(
        "serving CSI on {} (ublkd at {}, node {node_id})",
        endpoint.display(),
        ctl.socket().display()
    );
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        // Ending leaves every volume as it is: the devices are ublkd's.
        tracing::info!("stopping; every volume serves on");
    };
    Server::builder()
        .add_service(IdentityServer::new(IdentityService::new(ctl.clone())))
        .add_service(NodeServer::new(NodeService::new(ctl, node_id)))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
        .await
        .context("serving CSI")?;
    let _ = std::fs::remove_file(endpoint);
    Ok(())
}

/// Removes a socket left by a plugin that was killed; refuses to remove anything else.
fn remove_stale(endpoint: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(endpoint) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(endpoint)
            .with_context(|| format!("cannot remove the stale socket {}", endpoint.display())),
        Ok(_) => anyhow::bail!("{} exists and is not a socket", endpoint.display()),
        Err(_) => Ok(()),
    }
}
