//! The NBD protocol's handshake numbers (the supervisor negotiates; workers only
//! speak the transmission phase, whose numbers are in the parent module), each with
//! the section of the protocol document that defines it: <https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>.
//! Every integer on the wire is big-endian ("network byte order", "Conventions").

// "Handshake" > "Oldstyle negotiation" / "Newstyle negotiation".
/// The first 8 bytes of every handshake, ASCII `NBDMAGIC` (the `INIT_PASSWD`).
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// The second 8 bytes of a newstyle handshake, and the magic before every option the
/// client sends: ASCII `IHAVEOPT`.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// The second 8 bytes of an oldstyle handshake (`cliserv_magic`).
pub const CLISERV_MAGIC: u64 = 0x0000_4202_8186_1253;
/// The magic before every option reply ("Fixed newstyle negotiation").
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

// "Values" > "Handshake phase" > "Handshake flags" (sent by the server, 16 bits).
/// The server speaks fixed newstyle: options it does not know get an error reply
/// instead of a dropped connection.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// The server can leave out the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

// "Client flags" (sent by the client, 32 bits). A server drops the connection on a
// flag it did not offer, so each is set only if the server's matching flag is.
/// `NBD_FLAG_C_FIXED_NEWSTYLE`.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// `NBD_FLAG_C_NO_ZEROES`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// "Transmission flags" (16 bits, in `NBD_INFO_EXPORT`).
/// MUST always be set.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
/// The server errors every write.
pub const FLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_CMD_FLUSH` is supported.
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_CMD_FLAG_FUA` is supported.
pub const FLAG_SEND_FUA: u16 = 1 << 3;
/// The export behaves like a spinning disk.
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
/// `NBD_CMD_TRIM` is supported.
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_CMD_WRITE_ZEROES` (and `NBD_CMD_FLAG_NO_HOLE`) are supported.
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Flushes and FUA are visible on every connection to the export, so a client may
/// spread its requests over several.
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// "Option types".
/// Choose the export and enter transmission, with no way for the server to say why it
/// refuses (it closes the connection): the only option a server without fixed newstyle
/// knows, and ublkd's fallback where `NBD_OPT_GO` is unsupported.
pub const OPT_EXPORT_NAME: u32 = 1;
/// Abort the negotiation (the client's soft disconnect during option haggling).
pub const OPT_ABORT: u32 = 2;
/// Upgrade the connection to TLS; options continue inside it.
pub const OPT_STARTTLS: u32 = 5;
/// Ask for an export and enter transmission, with errors and `NBD_REP_INFO` replies.
pub const OPT_GO: u32 = 7;
/// Ask the server to answer with structured replies (chunks; holes not sent).
pub const OPT_STRUCTURED_REPLY: u32 = 8;

// "Option reply types". Errors have bit 31 set.
/// The option succeeded; for `NBD_OPT_GO`, transmission starts right after.
pub const REP_ACK: u32 = 1;
/// One piece of information about the export (`NBD_OPT_INFO` / `NBD_OPT_GO`).
pub const REP_INFO: u32 = 3;
/// Bit 31: the reply is an error.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// The server does not know the option.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// The server's policy forbids the option.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// The option was malformed.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// The option is not supported on the server's platform.
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
/// TLS first.
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// The export does not exist.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// The server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// The client must ask for `NBD_INFO_BLOCK_SIZE` (ublkd always does).
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
/// The request or the reply is too large.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

// "`NBD_REP_INFO`" information types.
/// Size (64 bits) and transmission flags (16 bits); length 12 with the type.
pub const INFO_EXPORT: u16 = 0;
/// The export's canonical name.
pub const INFO_NAME: u16 = 1;
/// A description for humans.
pub const INFO_DESCRIPTION: u16 = 2;
/// Minimum, preferred and maximum block size (32 bits each); length 14 with the type.
pub const INFO_BLOCK_SIZE: u16 = 3;

// "Block size constraints".
/// The largest minimum block size a server may advertise.
pub const MAX_MIN_BLOCK_SIZE: u32 = 1 << 16;
/// A maximum block size of "no inherent limit".
pub const BLOCK_SIZE_UNLIMITED: u32 = u32::MAX;

// "Conventions": strings (export names, error messages) are at most 4096 bytes.
/// The longest string the protocol allows.
pub const MAX_STRING_BYTES: usize = 4096;

/// The zeroes a server sends after its reply to `NBD_OPT_EXPORT_NAME`, unless both sides
/// agreed `NBD_FLAG_NO_ZEROES`.
pub const EXPORT_NAME_ZEROES: usize = 124;

/// The name of an option reply type, for messages.
pub fn reply_name(reply: u32) -> String {
    match reply {
        REP_ACK => "NBD_REP_ACK".into(),
        REP_INFO => "NBD_REP_INFO".into(),
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP".into(),
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY".into(),
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID".into(),
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM".into(),
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD".into(),
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN".into(),
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN".into(),
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD".into(),
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG".into(),
        other => format!("reply type {other:#x}"),
    }
}
