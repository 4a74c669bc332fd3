//! The per-device settings (`queues`, `queue_depth`, `block_size`, `threads`, the
//! sandbox's) as a `[[device]]` or `[defaults]` table writes them, and how a device's
//! own values override `[defaults]`.

use ublkd_proto::msg::LayerSet;

use crate::device::{check_block_size_wide, in_range};
use crate::{DeviceSettings, FieldError, MAX_QUEUE_DEPTH, MAX_QUEUES, MAX_THREADS};

/// The per-device settings a `[[device]]` or `[defaults]` table may set, as written.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Overrides {
    pub(crate) queues: Option<i128>,
    pub(crate) queue_depth: Option<i128>,
    pub(crate) block_size: Option<i128>,
    pub(crate) threads: Option<i128>,
    pub(crate) sandbox: Option<bool>,
    pub(crate) sandbox_optional: Option<LayerSet>,
}

impl Overrides {
    /// `base` with every set value replaced, each checked against its own limit.
    pub(crate) fn apply(&self, base: &DeviceSettings) -> Result<DeviceSettings, FieldError> {
        Ok(DeviceSettings {
            queues: match self.queues {
                Some(v) => in_range("queues", v, 1, MAX_QUEUES)?,
                None => base.queues,
            },
            queue_depth: match self.queue_depth {
                Some(v) => in_range("queue_depth", v, 1, MAX_QUEUE_DEPTH)?,
                None => base.queue_depth,
            },
            block_size: match self.block_size {
                Some(v) => check_block_size_wide(v)?,
                None => base.block_size,
            },
            threads: match self.threads {
                Some(v) => in_range("threads", v, 1, MAX_THREADS)?,
                None => base.threads,
            },
            sandbox: self.sandbox.unwrap_or(base.sandbox),
            sandbox_optional: self.sandbox_optional.unwrap_or(base.sandbox_optional),
        })
    }

    /// Whether `field` was left to `[defaults]`.
    pub(crate) fn inherits(&self, field: &str) -> bool {
        match field {
            "queues" => self.queues.is_none(),
            "queue_depth" => self.queue_depth.is_none(),
            "block_size" => self.block_size.is_none(),
            "threads" => self.threads.is_none(),
            _ => false,
        }
    }
}
