//! The handshake against scripted servers: what a correct one yields, and the error
//! each kind of misbehaviour gets. The real servers are in `tests/nbd.rs`.

use std::io::{self, Cursor, Read, Write};
use std::time::Duration;

use super::*;

/// A server that sends `script` whatever the client says, and records what it says.
struct Scripted {
    input: Cursor<Vec<u8>>,
    sent: Vec<u8>,
}

impl Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sent.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn greeting(flags: u16) -> Vec<u8> {
    let mut out = NBDMAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out
}

fn reply(option: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut out = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut data = INFO_EXPORT.to_be_bytes().to_vec();
    data.extend_from_slice(&size.to_be_bytes());
    data.extend_from_slice(&flags.to_be_bytes());
    reply(OPT_GO, REP_INFO, &data)
}

fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut data = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for v in [min, preferred, max] {
        data.extend_from_slice(&v.to_be_bytes());
    }
    reply(OPT_GO, REP_INFO, &data)
}

/// The server takes structured replies.
fn sr_ack() -> Vec<u8> {
    reply(OPT_STRUCTURED_REPLY, REP_ACK, &[])
}

const BOTH: u16 = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
const RW: u16 = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA;

fn run(parts: &[Vec<u8>]) -> (Result<ExportInfo, NbdError>, Vec<u8>) {
    let (result, sent, _) = run_counting_unread(parts);
    (result, sent)
}

/// [`run`], also giving how many of the server's bytes the client left unread: a
/// handshake that succeeds must end exactly where the server's part of it ends.
fn run_counting_unread(parts: &[Vec<u8>]) -> (Result<ExportInfo, NbdError>, Vec<u8>, u64) {
    run_asking(parts, Replies::Structured)
}

/// [`run_counting_unread`], asking the server for `replies`.
fn run_asking(parts: &[Vec<u8>], replies: Replies) -> (Result<ExportInfo, NbdError>, Vec<u8>, u64) {
    let input = parts.concat();
    let mut server = Scripted { input: Cursor::new(input), sent: Vec::new() };
    let result = negotiate(&mut server, "disk", replies, Duration::from_secs(1));
    let unread = server.input.get_ref().len() as u64 - server.input.position();
    (result, server.sent, unread)
}

fn error(parts: &[Vec<u8>]) -> String {
    match run(parts).0 {
        Ok(info) => panic!("expected an error, got {info:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_correct_server_yields_size_flags_and_block_sizes() {
    let (result, sent) = run(&[
        greeting(BOTH),
        sr_ack(),
        // A name info the client did not ask for is ignored.
        reply(OPT_GO, REP_INFO, &[0, INFO_NAME as u8, b'x']),
        info_block_size(512, 4096, 1 << 25),
        info_export(1 << 30, RW | FLAG_SEND_TRIM),
        reply(OPT_GO, REP_ACK, &[]),
    ]);
    let info = result.unwrap();
    assert_eq!(info.size, 1 << 30);
    assert_eq!(info.block_sizes, Some(BlockSizes { min: 512, preferred: 4096, max: 1 << 25 }));
    assert!(info.can_flush() && info.can_fua() && info.can_trim());
    assert!(!info.read_only() && !info.can_write_zeroes() && !info.can_multi_conn());
    assert!(info.structured_replies);
    // Client flags: fixed newstyle and no zeroes, as offered.
    assert_eq!(sent[..4], (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    // Then NBD_OPT_STRUCTURED_REPLY, without data.
    let structured =
        [IHAVEOPT.to_be_bytes().to_vec(), OPT_STRUCTURED_REPLY.to_be_bytes().to_vec(), vec![0; 4]];
    assert_eq!(sent[4..20], structured.concat());
    // Then NBD_OPT_GO for "disk" asking for two infos.
    let mut want = IHAVEOPT.to_be_bytes().to_vec();
    want.extend_from_slice(&OPT_GO.to_be_bytes());
    want.extend_from_slice(&14u32.to_be_bytes());
    want.extend_from_slice(&4u32.to_be_bytes());
    want.extend_from_slice(b"disk");
    want.extend_from_slice(&[0, 2, 0, 0, 0, 3]);
    assert_eq!(sent[20..], want);
}

#[test]
fn a_client_that_wants_simple_replies_never_asks_for_structured_ones() {
    // The server would take them, but is not asked: its first reply is NBD_OPT_GO's.
    let (result, sent, unread) = run_asking(
        &[
            greeting(BOTH),
            info_block_size(512, 4096, 1 << 25),
            info_export(1 << 30, RW),
            reply(OPT_GO, REP_ACK, &[]),
        ],
        Replies::Simple,
    );
    let info = result.unwrap();
    assert!(!info.structured_replies);
    assert_eq!(info.size, 1 << 30);
    assert_eq!(unread, 0, "the handshake ends where the server's part of it ends");
    // The client flags, then NBD_OPT_GO straight away.
    assert_eq!(sent[..4], (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    assert_eq!(sent[4..12], IHAVEOPT.to_be_bytes());
    assert_eq!(sent[12..16], OPT_GO.to_be_bytes());
    let options: Vec<u32> = sent[4..]
        .windows(12)
        .filter(|w| w[..8] == IHAVEOPT.to_be_bytes())
        .map(|w| u32::from_be_bytes([w[8], w[9], w[10], w[11]]))
        .collect();
    assert_eq!(options, [OPT_GO], "only NBD_OPT_GO was sent");
}

#[test]
fn a_server_without_block_sizes_is_fine() {
    let (result, sent) = run(&[
        greeting(FLAG_FIXED_NEWSTYLE),
        // Structured replies declined: simple replies it is.
        reply(OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]),
        info_export(4096, FLAG_HAS_FLAGS | FLAG_READ_ONLY),
        reply(OPT_GO, REP_ACK, &[]),
    ]);
    let info = result.unwrap();
    assert!(info.read_only() && info.block_sizes.is_none() && !info.structured_replies);
    // No NO_ZEROES offered: the client must not set it.
    assert_eq!(sent[..4], FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
}

#[test]
fn an_unknown_export_is_named_with_the_servers_message_and_aborted() {
    let (result, sent) =
        run(&[greeting(BOTH), sr_ack(), reply(OPT_GO, REP_ERR_UNKNOWN, b"no such export\nsorry")]);
    let message = result.unwrap_err().to_string();
    assert_eq!(message, "the server has no export named \"disk\": no such export?sorry");
    let abort = [IHAVEOPT.to_be_bytes().as_slice(), &OPT_ABORT.to_be_bytes(), &[0; 4]].concat();
    assert!(sent.ends_with(&abort), "no NBD_OPT_ABORT sent");
}

#[test]
fn each_misbehaviour_gets_its_own_message() {
    let garbage = b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec();
    let oldstyle = [NBDMAGIC.to_be_bytes(), CLISERV_MAGIC.to_be_bytes()].concat();
    let mut huge = reply(OPT_GO, REP_INFO, &[]);
    huge[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
    let cases: Vec<(Vec<Vec<u8>>, &str)> = vec![
        (vec![garbage], "does not start with NBDMAGIC: it is not an NBD server"),
        (vec![oldstyle], "oldstyle servers are not supported"),
        (vec![NBDMAGIC.to_be_bytes().to_vec(), vec![7; 8]], "neither IHAVEOPT"),
        (
            vec![greeting(0)],
            "closed the connection when asked for the export \"disk\" with NBD_OPT_EXPORT_NAME \
             (it has no NBD_OPT_GO, so it cannot say why)",
        ),
        (
            vec![greeting(0), (1u64 << 20).to_be_bytes().to_vec(), RW.to_be_bytes().to_vec()],
            "closed the connection while choosing the export (NBD_OPT_EXPORT_NAME)",
        ),
        (vec![greeting(BOTH)], "closed the connection while asking for structured replies"),
        (vec![greeting(BOTH), sr_ack()], "closed the connection while asking for the export"),
        (vec![greeting(BOTH), vec![1; 20]], "not the reply magic"),
        // A reply to an option it was not asked (7: NBD_OPT_GO, before it was asked).
        (vec![greeting(BOTH), reply(OPT_GO, REP_ACK, &[])], "replied to option 7 while"),
        (
            vec![greeting(BOTH), reply(OPT_STRUCTURED_REPLY, REP_INFO, &[0, 0])],
            "answered NBD_OPT_STRUCTURED_REPLY with NBD_REP_INFO",
        ),
        (
            vec![greeting(BOTH), sr_ack(), reply(OPT_GO, REP_ERR_TLS_REQD, b"")],
            "requires TLS; use an nbds:// URI",
        ),
        (vec![greeting(BOTH), sr_ack(), huge], "claims 4294967295 bytes"),
        (
            vec![greeting(BOTH), sr_ack(), reply(OPT_GO, REP_ACK, &[])],
            "without sending NBD_INFO_EXPORT",
        ),
        (
            vec![greeting(BOTH), sr_ack(), reply(OPT_GO, REP_INFO, &[0, 0, 1])],
            "NBD_INFO_EXPORT is 3 bytes long, the protocol says 12",
        ),
        (vec![greeting(BOTH), sr_ack(), reply(OPT_GO, REP_INFO, &[0])], "has no information type"),
        (
            vec![
                greeting(BOTH),
                sr_ack(),
                info_export(4096, RW),
                reply(OPT_GO, REP_ERR_UNSUP, &[]),
            ],
            "refused NBD_OPT_GO with NBD_REP_ERR_UNSUP",
        ),
        (
            vec![greeting(BOTH), sr_ack(), reply(OPT_GO, REP_ERR_POLICY, b"go away")],
            "refused NBD_OPT_GO with NBD_REP_ERR_POLICY: go away",
        ),
        (
            vec![greeting(BOTH), sr_ack(), reply(OPT_GO, REP_ERR_SHUTDOWN, &[])],
            "the server is shutting down",
        ),
        (
            vec![
                greeting(BOTH),
                sr_ack(),
                info_block_size(3, 4096, 1 << 20),
                info_export(1 << 20, RW),
                reply(OPT_GO, REP_ACK, &[]),
            ],
            "minimum block size 3 is not a power of two",
        ),
        (
            vec![
                greeting(BOTH),
                sr_ack(),
                info_block_size(512, 256, 1 << 20),
                info_export(1 << 20, RW),
                reply(OPT_GO, REP_ACK, &[]),
            ],
            "preferred block size 256",
        ),
        (
            vec![
                greeting(BOTH),
                sr_ack(),
                info_block_size(512, 4096, 1000),
                info_export(1 << 20, RW),
                reply(OPT_GO, REP_ACK, &[]),
            ],
            "maximum block size 1000",
        ),
        (vec![greeting(BOTH), sr_ack(), info_export(4096, RW).repeat(40)], "more than 32 replies"),
    ];
    for (parts, part) in cases {
        let message = error(&parts);
        assert!(message.contains(part), "{part:?} not in {message:?}");
    }
}

/// The option `NBD_OPT_EXPORT_NAME` with "disk", as the client sends it.
fn export_name_option() -> Vec<u8> {
    [
        IHAVEOPT.to_be_bytes().as_slice(),
        &OPT_EXPORT_NAME.to_be_bytes(),
        &4u32.to_be_bytes(),
        b"disk",
    ]
    .concat()
}

/// The reply to `NBD_OPT_EXPORT_NAME`: size, flags and, unless agreed away, 124 zeroes.
fn export_name_reply(size: u64, flags: u16, zeroes: bool) -> Vec<u8> {
    let mut out = size.to_be_bytes().to_vec();
    out.extend_from_slice(&flags.to_be_bytes());
    if zeroes {
        out.extend_from_slice(&[0; EXPORT_NAME_ZEROES]);
    }
    out
}

#[test]
fn a_server_without_fixed_newstyle_is_asked_only_nbd_opt_export_name() {
    let (result, sent, unread) =
        run_counting_unread(&[greeting(0), export_name_reply(1 << 30, RW, true)]);
    let info = result.unwrap();
    assert_eq!(unread, 0, "the 124 zeroes were not read");
    assert_eq!((info.size, info.transmission_flags), (1 << 30, RW));
    assert!(info.export_name_option && !info.structured_replies && info.block_sizes.is_none());
    // No client flag it did not offer, then the option and nothing else.
    assert_eq!(sent, [0u32.to_be_bytes().as_slice(), &export_name_option()].concat());
    assert!(info.to_string().contains("chosen with NBD_OPT_EXPORT_NAME"), "{info}");
}

#[test]
fn a_fixed_newstyle_server_without_nbd_opt_go_gets_nbd_opt_export_name_after_it() {
    // With NO_ZEROES agreed, no zeroes follow; structured replies agreed before hold.
    let (result, sent) = run(&[
        greeting(BOTH),
        sr_ack(),
        reply(OPT_GO, REP_ERR_UNSUP, b"unknown option"),
        export_name_reply(1 << 20, RW | FLAG_READ_ONLY, false),
    ]);
    let info = result.unwrap();
    assert_eq!(info.size, 1 << 20);
    assert!(info.read_only() && info.structured_replies && info.export_name_option);
    assert!(sent.ends_with(&export_name_option()), "NBD_OPT_EXPORT_NAME not sent last");
    // A server that offered no NO_ZEROES sends the zeroes, and they are read, all of
    // them and nothing after.
    let (result, _, unread) = run_counting_unread(&[
        greeting(FLAG_FIXED_NEWSTYLE),
        reply(OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]),
        reply(OPT_GO, REP_ERR_UNSUP, &[]),
        export_name_reply(4096, RW, true),
    ]);
    let info = result.unwrap();
    assert_eq!(unread, 0, "the 124 zeroes were not read");
    assert!(info.export_name_option && !info.structured_replies);
}
