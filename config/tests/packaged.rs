//! The config file the package installs as /etc/ublkd/ublkd.toml must load and create no
//! device by itself.

#[test]
fn the_packaged_default_config_is_valid_and_has_no_devices() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/ublkd.toml");
    let config = ublkd_config::Config::load(std::path::Path::new(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(config.devices.is_empty(), "the packaged config creates devices: {:?}", config.devices);
    assert_eq!(config.daemon.socket, std::path::Path::new(ublkd_config::DEFAULT_SOCKET));
}
