//! Checks `proto::uapi` against the real kernel header.
//!
//! Compiles a C program against `linux/ublk_cmd.h` from Debian's `linux-libc-dev`
//! ≥ 7.0 (fetched by the test VM harness into its cache; `./run-tests` does that
//! first) and compares every struct size, field offset and constant with the Rust
//! values. The header is found in `$UBLKD_UAPI_INCLUDE`, else in the newest
//! `$UBLKD_VM_CACHE/headers/*/usr/include` (default cache `/var/cache/ublkd-vm`).
//! Without it the test fails, saying how to get it: it never passes by skipping.

use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use ublkd_proto::uapi::*;

/// `(C expression, Rust value)`. Rust field names equal the header's, so one name
/// serves both sides.
fn expectations() -> Vec<(String, i64)> {
    let mut v: Vec<(String, i64)> = Vec::new();
    // `layout!(RustType, "c_struct"; field…)`: the size and every field's offset.
    macro_rules! layout {
        ($rs:ty, $c:literal; $($f:ident)*) => {
            v.push((format!("sizeof(struct {})", $c), size_of::<$rs>() as i64));
            $(v.push((format!("offsetof(struct {}, {})", $c, stringify!($f)), offset_of!($rs, $f) as i64));)*
        };
    }
    macro_rules! konst {
        ($($name:ident),* $(,)?) => {
            $(v.push((stringify!($name).to_string(), $name as i64));)*
        };
    }

    layout!(UblksrvCtrlCmd, "ublksrv_ctrl_cmd"; dev_id queue_id len addr data dev_path_len pad reserved);
    layout!(UblksrvCtrlDevInfo, "ublksrv_ctrl_dev_info"; nr_hw_queues queue_depth state pad0 max_io_buf_bytes dev_id ublksrv_pid pad1 flags ublksrv_flags owner_uid owner_gid reserved1 reserved2);
    layout!(UblksrvIoDesc, "ublksrv_io_desc"; op_flags nr_sectors start_sector addr);
    layout!(UblksrvIoCmd, "ublksrv_io_cmd"; q_id tag result addr);
    layout!(UblkAutoBufReg, "ublk_auto_buf_reg"; index flags reserved0 reserved1);
    layout!(UblkElemHeader, "ublk_elem_header"; tag buf_index result);
    layout!(UblkBatchIo, "ublk_batch_io"; q_id flags nr_elem elem_bytes reserved reserved2);
    layout!(UblkParamBasic, "ublk_param_basic"; attrs logical_bs_shift physical_bs_shift io_opt_shift io_min_shift max_sectors chunk_sectors dev_sectors virt_boundary_mask);
    layout!(UblkParamDiscard, "ublk_param_discard"; discard_alignment discard_granularity max_discard_sectors max_write_zeroes_sectors max_discard_segments reserved0);
    layout!(UblkParamDevt, "ublk_param_devt"; char_major char_minor disk_major disk_minor);
    layout!(UblkParamZoned, "ublk_param_zoned"; max_open_zones max_active_zones max_zone_append_sectors reserved);
    layout!(UblkParamDmaAlign, "ublk_param_dma_align"; alignment pad);
    layout!(UblkParamSegment, "ublk_param_segment"; seg_boundary_mask max_segment_size max_segments pad);
    layout!(UblkParamIntegrity, "ublk_param_integrity"; flags max_integrity_segments interval_exp metadata_size pi_offset csum_type tag_size pad);
    layout!(UblkParams, "ublk_params"; len types basic discard devt zoned dma seg integrity);

    konst!(
        UBLK_CMD_GET_QUEUE_AFFINITY,
        UBLK_CMD_GET_DEV_INFO,
        UBLK_CMD_ADD_DEV,
        UBLK_CMD_DEL_DEV,
        UBLK_CMD_START_DEV,
        UBLK_CMD_STOP_DEV,
        UBLK_CMD_SET_PARAMS,
        UBLK_CMD_GET_PARAMS,
        UBLK_CMD_START_USER_RECOVERY,
        UBLK_CMD_END_USER_RECOVERY,
        UBLK_CMD_GET_DEV_INFO2,
        UBLK_U_CMD_GET_QUEUE_AFFINITY,
        UBLK_U_CMD_GET_DEV_INFO,
        UBLK_U_CMD_ADD_DEV,
        UBLK_U_CMD_DEL_DEV,
        UBLK_U_CMD_START_DEV,
        UBLK_U_CMD_STOP_DEV,
        UBLK_U_CMD_SET_PARAMS,
        UBLK_U_CMD_GET_PARAMS,
        UBLK_U_CMD_START_USER_RECOVERY,
        UBLK_U_CMD_END_USER_RECOVERY,
        UBLK_U_CMD_GET_DEV_INFO2,
        UBLK_U_CMD_GET_FEATURES,
        UBLK_U_CMD_DEL_DEV_ASYNC,
        UBLK_U_CMD_UPDATE_SIZE,
        UBLK_U_CMD_QUIESCE_DEV,
        UBLK_U_CMD_TRY_STOP_DEV,
        UBLK_FEATURES_LEN,
        UBLK_IO_FETCH_REQ,
        UBLK_IO_COMMIT_AND_FETCH_REQ,
        UBLK_IO_NEED_GET_DATA,
        UBLK_U_IO_FETCH_REQ,
        UBLK_U_IO_COMMIT_AND_FETCH_REQ,
        UBLK_U_IO_NEED_GET_DATA,
        UBLK_U_IO_REGISTER_IO_BUF,
        UBLK_U_IO_UNREGISTER_IO_BUF,
        UBLK_U_IO_PREP_IO_CMDS,
        UBLK_U_IO_COMMIT_IO_CMDS,
        UBLK_U_IO_FETCH_IO_CMDS,
        UBLK_IO_RES_OK,
        UBLK_IO_RES_NEED_GET_DATA,
        UBLK_IO_RES_ABORT,
        UBLKSRV_CMD_BUF_OFFSET,
        UBLKSRV_IO_BUF_OFFSET,
        UBLK_MAX_QUEUE_DEPTH,
        UBLK_IO_BUF_OFF,
        UBLK_IO_BUF_BITS,
        UBLK_IO_BUF_BITS_MASK,
        UBLK_TAG_OFF,
        UBLK_TAG_BITS,
        UBLK_TAG_BITS_MASK,
        UBLK_QID_OFF,
        UBLK_QID_BITS,
        UBLK_QID_BITS_MASK,
        UBLK_MAX_NR_QUEUES,
        UBLKSRV_IO_BUF_TOTAL_BITS,
        UBLKSRV_IO_BUF_TOTAL_SIZE,
        UBLK_F_SUPPORT_ZERO_COPY,
        UBLK_F_URING_CMD_COMP_IN_TASK,
        UBLK_F_NEED_GET_DATA,
        UBLK_F_USER_RECOVERY,
        UBLK_F_USER_RECOVERY_REISSUE,
        UBLK_F_UNPRIVILEGED_DEV,
        UBLK_F_CMD_IOCTL_ENCODE,
        UBLK_F_USER_COPY,
        UBLK_F_ZONED,
        UBLK_F_USER_RECOVERY_FAIL_IO,
        UBLK_F_UPDATE_SIZE,
        UBLK_F_AUTO_BUF_REG,
        UBLK_F_QUIESCE,
        UBLK_F_PER_IO_DAEMON,
        UBLK_F_BUF_REG_OFF_DAEMON,
        UBLK_F_BATCH_IO,
        UBLK_F_INTEGRITY,
        UBLK_F_SAFE_STOP_DEV,
        UBLK_F_NO_AUTO_PART_SCAN,
        UBLK_F_SHMEM_ZC,
        UBLK_S_DEV_DEAD,
        UBLK_S_DEV_LIVE,
        UBLK_S_DEV_QUIESCED,
        UBLK_S_DEV_FAIL_IO,
        UBLK_IO_OP_READ,
        UBLK_IO_OP_WRITE,
        UBLK_IO_OP_FLUSH,
        UBLK_IO_OP_DISCARD,
        UBLK_IO_OP_WRITE_SAME,
        UBLK_IO_OP_WRITE_ZEROES,
        UBLK_IO_OP_ZONE_OPEN,
        UBLK_IO_OP_ZONE_CLOSE,
        UBLK_IO_OP_ZONE_FINISH,
        UBLK_IO_OP_ZONE_APPEND,
        UBLK_IO_OP_ZONE_RESET_ALL,
        UBLK_IO_OP_ZONE_RESET,
        UBLK_IO_OP_REPORT_ZONES,
        UBLK_IO_F_FAILFAST_DEV,
        UBLK_IO_F_FAILFAST_TRANSPORT,
        UBLK_IO_F_FAILFAST_DRIVER,
        UBLK_IO_F_META,
        UBLK_IO_F_FUA,
        UBLK_IO_F_NOUNMAP,
        UBLK_IO_F_SWAP,
        UBLK_IO_F_NEED_REG_BUF,
        UBLK_IO_F_INTEGRITY,
        UBLK_IO_F_SHMEM_ZC,
        UBLK_AUTO_BUF_REG_FALLBACK,
        UBLK_AUTO_BUF_REG_F_MASK,
        UBLK_BATCH_F_HAS_ZONE_LBA,
        UBLK_BATCH_F_HAS_BUF_ADDR,
        UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK,
        UBLK_ATTR_READ_ONLY,
        UBLK_ATTR_ROTATIONAL,
        UBLK_ATTR_VOLATILE_CACHE,
        UBLK_ATTR_FUA,
        UBLK_MIN_SEGMENT_SIZE,
        UBLK_PARAM_TYPE_BASIC,
        UBLK_PARAM_TYPE_DISCARD,
        UBLK_PARAM_TYPE_DEVT,
        UBLK_PARAM_TYPE_ZONED,
        UBLK_PARAM_TYPE_DMA_ALIGN,
        UBLK_PARAM_TYPE_SEGMENT,
        UBLK_PARAM_TYPE_INTEGRITY,
        IORING_URING_CMD_MULTISHOT,
        IORING_RECVSEND_FIXED_BUF,
        IORING_UNREGISTER_BUFFERS,
        IORING_UNREGISTER_FILES,
        IORING_REGISTER_FILES_UPDATE,
        IORING_REGISTER_PERSONALITY,
    );
    v
}

fn newest_cached_include(cache: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(cache.join("headers"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("usr/include")))
        .filter(|p| p.join("linux/ublk_cmd.h").is_file())
        .collect();
    // Versions are dotted numbers; compare them numerically so 7.10 sorts after 7.9.
    dirs.sort_by_key(|p| {
        let version = p.parent().and_then(Path::parent).and_then(Path::file_name);
        version
            .and_then(|v| v.to_str())
            .map(|v| {
                v.split(|c: char| !c.is_ascii_digit())
                    .filter_map(|n| n.parse::<u64>().ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    });
    dirs.pop()
}

fn include_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("UBLKD_UAPI_INCLUDE") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("UBLKD_VM_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/ublkd-vm"), PathBuf::from);
    newest_cached_include(&cache).unwrap_or_else(|| {
        panic!(
            "no linux-libc-dev >= 7.0 headers in {}/headers: run `./run-tests` (or \
             `cargo run -p ublkd-tests --bin ublkd-vm -- fetch`) to fetch them, or set \
             UBLKD_UAPI_INCLUDE to a directory holding linux/ublk_cmd.h",
            cache.display()
        )
    })
}

#[test]
fn rust_uapi_matches_the_kernel_header() {
    let include = include_dir();
    let header = include.join("linux/ublk_cmd.h");
    assert!(header.is_file(), "{} does not exist", header.display());

    let expected = expectations();
    let mut c = String::from(
        "#include <errno.h>\n#include <stddef.h>\n#include <stdio.h>\n#include <linux/ioctl.h>\n#include <linux/io_uring.h>\n#include <linux/ublk_cmd.h>\n\
         int main(void) {\n",
    );
    for (expr, _) in &expected {
        c.push_str(&format!("    printf(\"%lld\\n\", (long long)({expr}));\n"));
    }
    c.push_str("    return 0;\n}\n");

    let dir = std::env::temp_dir().join(format!("ublkd-uapi-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("check.c");
    let bin = dir.join("check");
    std::fs::write(&src, c).unwrap();
    let cc = Command::new("cc")
        .arg("-Wall")
        .arg("-Werror")
        // The fetched headers come first; libc's own come from the system.
        .arg("-isystem")
        .arg(&include)
        .arg("-isystem")
        .arg(include.join("x86_64-linux-gnu"))
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("cannot run cc (install gcc)");
    assert!(
        cc.status.success(),
        "compiling against {} failed (is it linux-libc-dev >= 7.0?):\n{}",
        header.display(),
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&bin).output().unwrap();
    assert!(out.status.success());
    let _ = std::fs::remove_dir_all(&dir);

    let got: Vec<i64> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(got.len(), expected.len());
    let mismatches: Vec<String> = expected
        .iter()
        .zip(&got)
        .filter(|((_, rust), c)| rust != *c)
        .map(|((expr, rust), c)| format!("{expr}: header says {c:#x}, proto::uapi says {rust:#x}"))
        .collect();
    assert!(
        mismatches.is_empty(),
        "uapi differs from {}:\n{}",
        header.display(),
        mismatches.join("\n")
    );
    eprintln!(
        "checked {} sizes, offsets and constants against {}",
        expected.len(),
        header.display()
    );
}

#[test]
fn every_feature_flag_in_the_header_is_named() {
    // A flag the header defines but FEATURES lacks would print as BIT_n.
    let include = include_dir();
    let text = std::fs::read_to_string(include.join("linux/ublk_cmd.h")).unwrap();
    let defined: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("#define UBLK_F_"))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    let named: Vec<&str> = FEATURES.iter().map(|(_, n)| *n).collect();
    for flag in &defined {
        assert!(named.contains(flag), "UBLK_F_{flag} is in the header but not in uapi::FEATURES");
    }
    assert_eq!(defined.len(), named.len(), "header flags: {defined:?}");
}
