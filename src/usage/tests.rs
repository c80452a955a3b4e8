//! The scan against recorded-shape bodies of each preset, fed whole and
//! split everywhere, and against hostile bodies: exact values, bounded
//! state, no panics.

use super::*;
use proptest::prelude::*;

fn meter(terms: Vec<Term>) -> Meter {
    Meter {
        terms,
        max: u64::MAX,
        scan_limit: 1 << 30,
    }
}

fn pointer(s: &str) -> Path {
    Path::parse(s).unwrap()
}

/// One term per pointer, weight 1.
fn terms(pointers: &[&str]) -> Vec<Term> {
    pointers
        .iter()
        .map(|p| Term {
            any_of: vec![pointer(p)],
            weight: 1,
        })
        .collect()
}

fn scan_chunks<'a>(
    m: &Meter,
    framing: Framing,
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> Usage {
    let mut scan = Scan::new(m, framing);
    let before = scan.state_bytes();
    for chunk in chunks {
        scan.feed(m, chunk);
    }
    assert_eq!(scan.state_bytes(), before, "the scan's state grew");
    scan.finish(m)
}

fn whole(m: &Meter, framing: Framing, body: &[u8]) -> Usage {
    scan_chunks(m, framing, [body])
}

/// The usage of `body` fed whole, and the same fed in two pieces split at
/// every position and in 1-byte chunks.
fn everywhere(m: &Meter, framing: Framing, body: &[u8]) -> Usage {
    let expected = whole(m, framing, body);
    for at in 0..=body.len() {
        let (a, b) = body.split_at(at);
        assert_eq!(scan_chunks(m, framing, [a, b]), expected, "split at {at}");
    }
    assert_eq!(
        scan_chunks(m, framing, body.chunks(1)),
        expected,
        "1-byte chunks"
    );
    assert_eq!(
        scan_chunks(m, framing, body.chunks(7)),
        expected,
        "7-byte chunks"
    );
    expected
}

fn found(cost: u64) -> Usage {
    Usage::Found {
        cost,
        capped: false,
    }
}

fn json(pointers: &[&str], body: &str) -> Usage {
    everywhere(&meter(terms(pointers)), Framing::Json, body.as_bytes())
}

fn sse(pointers: &[&str], body: &str) -> Usage {
    everywhere(&meter(terms(pointers)), Framing::Sse, body.as_bytes())
}

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/usage/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn each_preset_charges_the_exact_sum_of_its_fixtures() {
    let cases = [
        (
            Preset::OpenaiChat,
            "openai_chat.json",
            Framing::Json,
            1117 + 46,
        ),
        (Preset::OpenaiChat, "openai_chat.sse", Framing::Sse, 19 + 10),
        (
            Preset::OpenaiResponses,
            "openai_responses.json",
            Framing::Json,
            36 + 87,
        ),
        (
            Preset::OpenaiResponses,
            "openai_responses.sse",
            Framing::Sse,
            37 + 11,
        ),
        (
            Preset::AnthropicMessages,
            "anthropic_messages.json",
            Framing::Json,
            2095 + 503,
        ),
        (
            Preset::AnthropicMessages,
            "anthropic_messages.sse",
            Framing::Sse,
            25 + 15,
        ),
    ];
    for (preset, name, framing, cost) in cases {
        let m = meter(preset::terms(preset));
        assert_eq!(
            everywhere(&m, framing, &fixture(name)),
            found(cost),
            "{name}"
        );
    }
}

#[test]
fn a_stream_cut_before_its_usage_is_missing() {
    let body = fixture("openai_chat.sse");
    let cut = body.len() - 300;
    let m = meter(preset::terms(Preset::OpenaiChat));
    assert_eq!(
        whole(&m, Framing::Sse, body.get(..cut).unwrap()),
        Usage::Missing
    );
    let body = fixture("openai_chat.json");
    assert_eq!(
        whole(&m, Framing::Json, body.get(..body.len() - 3).unwrap()),
        Usage::Missing
    );
}

#[test]
fn anthropic_input_tokens_come_from_the_last_event_that_has_them() {
    let m = meter(preset::terms(Preset::AnthropicMessages));
    let body = "event: message_start\n\
        data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
        event: message_delta\n\
        data: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"input_tokens\":30,\"output_tokens\":15}}\n\n\
        event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    assert_eq!(everywhere(&m, Framing::Sse, body.as_bytes()), found(45));
}

#[test]
fn pointers_parse_as_rfc_6901_says() {
    assert_eq!(pointer(""), Path(vec![]));
    assert_eq!(
        pointer("/usage/total_tokens"),
        Path(vec![b"usage".to_vec(), b"total_tokens".to_vec()])
    );
    assert_eq!(
        pointer("/a~1b/m~0n/"),
        Path(vec![b"a/b".to_vec(), b"m~n".to_vec(), vec![]])
    );
    assert_eq!(pointer("/~01"), Path(vec![b"~1".to_vec()]));
    for bad in ["usage", "/a~2", "/a~", "/~x"] {
        assert!(Path::parse(bad).is_err(), "{bad}");
    }
    assert!(Path::parse(&"/a".repeat(16)).is_ok());
    let too_many = Path::parse(&"/a".repeat(17)).unwrap_err();
    assert!(too_many.contains("16 segments"), "{too_many}");
    assert!(Path::parse(&format!("/{}", "x".repeat(128))).is_ok());
    let too_long = Path::parse(&format!("/{}", "x".repeat(129))).unwrap_err();
    assert!(too_long.contains("128 bytes"), "{too_long}");
}

#[test]
fn values_are_found_at_their_paths() {
    let p = ["/usage/a", "/usage/b"];
    assert_eq!(json(&p, r#"{"usage":{"a":1,"b":2}}"#), found(3));
    assert_eq!(
        json(
            &p,
            r#" { "x" : [1, {"usage": {"a": 9}}], "usage" : { "b" : 20 , "a" : 10 } } "#
        ),
        found(30)
    );
    assert_eq!(json(&["/usage"], r#"{"usage":0}"#), found(0));
    assert_eq!(json(&[""], "42"), found(42));
    assert_eq!(json(&[""], " 42 \n"), found(42));
    // Deeper or shallower than the path is not it.
    assert_eq!(json(&p, r#"{"usage":{"a":{"a":1},"b":2}}"#), Usage::Missing);
    assert_eq!(json(&p, r#"{"a":1,"b":2}"#), Usage::Missing);
    assert_eq!(json(&p, r#"{"usage":{"a":1}}"#), Usage::Missing);
    assert_eq!(json(&p, r#"{"usage":{"a":1,"bb":2,"b":3}}"#), found(4));
}

#[test]
fn weights_multiply_and_the_max_caps() {
    let mut m = meter(vec![
        Term {
            any_of: vec![pointer("/in")],
            weight: 1,
        },
        Term {
            any_of: vec![pointer("/out")],
            weight: 4,
        },
    ]);
    let body = br#"{"in":10,"out":5}"#;
    assert_eq!(everywhere(&m, Framing::Json, body), found(30));
    m.max = 30;
    assert_eq!(whole(&m, Framing::Json, body), found(30));
    m.max = 29;
    assert_eq!(
        whole(&m, Framing::Json, body),
        Usage::Found {
            cost: 29,
            capped: true
        }
    );
}

#[test]
fn any_of_takes_the_first_path_the_document_has() {
    let m = meter(vec![Term {
        any_of: vec![pointer("/a"), pointer("/b")],
        weight: 1,
    }]);
    assert_eq!(whole(&m, Framing::Json, br#"{"b":2,"a":1}"#), found(1));
    assert_eq!(whole(&m, Framing::Json, br#"{"b":2}"#), found(2));
    assert_eq!(whole(&m, Framing::Json, br#"{"a":null,"b":2}"#), found(2));
    assert_eq!(
        whole(&m, Framing::Json, br#"{"a":"1","b":2}"#),
        Usage::Missing
    );
    assert_eq!(whole(&m, Framing::Json, br#"{"c":2}"#), Usage::Missing);
}

#[test]
fn huge_values_saturate_and_are_capped() {
    assert_eq!(
        json(&["/n"], r#"{"n":1000000000000}"#),
        found(1_000_000_000_000)
    );
    let mut m = meter(vec![Term {
        any_of: vec![pointer("/n")],
        weight: 1000,
    }]);
    m.max = 5000;
    let forty = format!(r#"{{"n":{}}}"#, "9".repeat(40));
    let capped = Usage::Found {
        cost: 5000,
        capped: true,
    };
    assert_eq!(everywhere(&m, Framing::Json, forty.as_bytes()), capped);
    assert_eq!(whole(&m, Framing::Json, br#"{"n":1000000000000}"#), capped);
    m.max = u64::MAX;
    assert_eq!(
        whole(&m, Framing::Json, forty.as_bytes()),
        Usage::Found {
            cost: u64::MAX,
            capped: false
        }
    );
    let two = meter(terms(&["/a", "/b"]));
    let body = format!(r#"{{"a":{0},"b":{0}}}"#, u64::MAX);
    assert_eq!(whole(&two, Framing::Json, body.as_bytes()), found(u64::MAX));
}

#[test]
fn only_non_negative_integers_are_values() {
    for v in [
        "12.0",
        "1e3",
        "1E+3",
        "-5",
        "-0",
        "\"5\"",
        "null",
        "true",
        "false",
        "{}",
        "[]",
        "[1]",
        "{\"n\":1}",
    ] {
        assert_eq!(
            json(&["/n"], &format!(r#"{{"n":{v}}}"#)),
            Usage::Missing,
            "{v}"
        );
    }
    // Not JSON numbers at all.
    for v in [
        "01", "1.", ".5", "+1", "1e", "--1", "0x10", "Infinity", "nul", "truex",
    ] {
        assert_eq!(
            json(&["/n"], &format!(r#"{{"n":{v}}}"#)),
            Usage::Missing,
            "{v}"
        );
    }
    // Numbers elsewhere may be anything JSON allows.
    assert_eq!(
        json(&["/n"], r#"{"x":[-1.5e-3,0,0.25E2,-0],"n":7}"#),
        found(7)
    );
}

#[test]
fn malformed_or_truncated_documents_are_missing() {
    let p = ["/n"];
    assert_eq!(json(&p, "{\"n\":1}\n\t "), found(1));
    for bad in [
        "",
        "{",
        "{\"n\":1",
        "{\"n\":1,}",
        "{\"n\" 1}",
        "{\"n\":1}}",
        "{\"n\":1}x",
        "{\"n\":1}{}",
        "{\"n\":1]",
        "[\"n\"}",
        "{n:1}",
        "{\"n\":1,\"x\":[1,]}",
        "{\"n\":1,\"x\":\"a\\q\"}",
        "{\"n\":1,\"x\":\"\\u12G4\"}",
        "{\"n\":1,\"x\":\"open}",
        "{\"n\":1 \"x\":2}",
        "{,\"n\":1}",
        "[1 2]",
        "{\"n\":1,\"x\":[}]}",
    ] {
        assert_eq!(json(&p, bad), Usage::Missing, "{bad}");
    }
}

/// Escapes inside a value are checked where the string's run finds them,
/// wherever a chunk splits them.
#[test]
fn escapes_in_values_are_checked_in_the_run() {
    let p = ["/n"];
    let m = meter(terms(&p));
    let good = r#"{"x":"a\"b\\c\/d\be\ff\ng\rh\ti\u00e9j\n\n","n":7}"#;
    assert_eq!(everywhere(&m, Framing::Json, good.as_bytes()), found(7));
    for bad in [
        r#"{"x":"a\qb","n":7}"#,
        r#"{"x":"a\u00g9","n":7}"#,
        r#"{"x":"\"#,
    ] {
        assert_eq!(
            everywhere(&m, Framing::Json, bad.as_bytes()),
            Usage::Missing,
            "{bad}"
        );
    }
}

#[test]
fn keys_are_compared_decoded() {
    let p = ["/usage/prompt_tokens"];
    assert_eq!(
        json(&p, r#"{"\u0075sage":{"prompt\u005Ftokens":3}}"#),
        found(3)
    );
    assert_eq!(json(&["/a~1b"], r#"{"a\/b":4}"#), found(4));
    assert_eq!(json(&["/a\"b\\c\nd"], r#"{"a\"b\\c\nd":5}"#), found(5));
    assert_eq!(
        json(&["/\u{e9}\u{1f600}"], r#"{"\u00e9\ud83d\ude00":6}"#),
        found(6)
    );
    assert_eq!(
        json(&["/\u{e9}\u{1f600}"], "{\"\u{e9}\u{1f600}\":6}"),
        found(6)
    );
    // A lone surrogate matches nothing, and is no error elsewhere.
    assert_eq!(json(&["/\u{fffd}"], r#"{"\ud83d":6}"#), Usage::Missing);
    assert_eq!(json(&["/n"], r#"{"\ud83dx":6,"\ude00":1,"n":2}"#), found(2));
    // A key longer than every segment, sharing its prefix.
    assert_eq!(
        json(&["/usage"], r#"{"usagex":1,"usag":2,"usage":3}"#),
        found(3)
    );
}

#[test]
fn array_segments_are_indices() {
    let p = ["/choices/1/n"];
    assert_eq!(
        json(&p, r#"{"choices":[{"n":1},{"n":2},{"n":3}]}"#),
        found(2)
    );
    assert_eq!(json(&p, r#"{"choices":[{"n":1}]}"#), Usage::Missing);
    assert_eq!(json(&["/a/0"], r#"{"a":[[5],7]}"#), Usage::Missing);
    assert_eq!(json(&["/a/1"], r#"{"a":[[5],7]}"#), found(7));
    assert_eq!(json(&["/a/01"], r#"{"a":[1,2]}"#), Usage::Missing);
    assert_eq!(json(&["/a/x"], r#"{"a":[1,2]}"#), Usage::Missing);
    assert_eq!(json(&["/a/1"], r#"{"a":{"1":9}}"#), found(9));
    assert_eq!(json(&["/0/1"], r#"[[1,2],[3,4]]"#), found(2));
}

#[test]
fn the_last_duplicate_key_wins() {
    assert_eq!(json(&["/n"], r#"{"n":1,"n":2}"#), found(2));
    assert_eq!(json(&["/n"], r#"{"n":1,"n":null}"#), Usage::Missing);
    assert_eq!(json(&["/n"], r#"{"n":"x","n":3}"#), found(3));
    assert_eq!(
        json(&["/u/a"], r#"{"u":{"a":1},"u":{"b":2}}"#),
        Usage::Missing
    );
    assert_eq!(json(&["/u/a"], r#"{"u":{"a":1},"u":{"a":5}}"#), found(5));
}

#[test]
fn each_term_takes_the_last_event_that_has_it() {
    let p = ["/a", "/b"];
    let body =
        "data: {\"a\":1}\n\ndata: {\"a\":2,\"b\":null}\n\ndata: {\"b\":3}\n\ndata: {\"c\":4}\n\n";
    assert_eq!(sse(&p, body), found(5));
    // An invalid value in the last event that has the path.
    assert_eq!(
        sse(&p, "data: {\"a\":1,\"b\":2}\n\ndata: {\"a\":1.5}\n\n"),
        Usage::Missing
    );
    assert_eq!(sse(&p, "data: {\"a\":1}\n\n"), Usage::Missing);
}

#[test]
fn events_that_are_not_json_add_nothing() {
    let p = ["/a"];
    assert_eq!(sse(&p, "data: {\"a\":1}\n\ndata: [DONE]\n\n"), found(1));
    assert_eq!(sse(&p, "data: {\"a\":1}\n\ndata: {\"a\":2\n\n"), found(1));
    assert_eq!(
        sse(&p, "data: {\"a\":1}\n\ndata: {\"a\":2} x\n\n"),
        found(1)
    );
    assert_eq!(sse(&p, "data: {\"a\":1}\n\ndata\n\n"), found(1));
    assert_eq!(sse(&p, "data: [DONE]\n\n"), Usage::Missing);
    assert_eq!(sse(&p, ""), Usage::Missing);
}

#[test]
fn sse_lines_follow_the_whatwg_rules() {
    let p = ["/a", "/b"];
    // Line ends of every kind, `\r\n` split across chunks by `everywhere`.
    assert_eq!(sse(&p, "data: {\"a\":1,\"b\":2}\r\n\r\n"), found(3));
    assert_eq!(sse(&p, "data: {\"a\":1,\"b\":2}\r\r"), found(3));
    assert_eq!(sse(&p, "data:{\"a\":1,\"b\":2}\n\n"), found(3));
    // Data lines joined with `\n`, comments and other fields ignored.
    let body = ": keep-alive\r\nevent: usage\r\nid: 7\r\ndata: {\"a\":\r\nretry: 10\r\ndata:  10,\r\n:x\r\ndata:\"b\"\ndata\ndata: :20}\r\n\r\n";
    assert_eq!(sse(&p, body), found(30));
    // Only `data` is data; one leading space is dropped, not two.
    assert_eq!(
        sse(
            &p,
            "dat: {\"a\":9}\ndatax: {\"a\":9}\nDATA: {}\ndata: {\"a\":1,\"b\":2}\n\n"
        ),
        found(3)
    );
    assert_eq!(sse(&p, "data:  \t{\"a\":1,\"b\":2}\n\n"), found(3));
    // A blank line that is `\r` then `\n` of the previous line end.
    assert_eq!(
        sse(&p, "data: {\"a\":1,\r\n\r\ndata: \"b\":2}\r\n\r\n"),
        Usage::Missing
    );
}

#[test]
fn a_crlf_split_across_chunks_is_one_line_end() {
    let m = meter(terms(&["/a"]));
    // Two line ends would end the event after `{"a":`, and neither half is JSON.
    let chunks: [&[u8]; 3] = [b"data: {\"a\":\r", b"\ndata: 1}\r", b"\n\r\n"];
    assert_eq!(scan_chunks(&m, Framing::Sse, chunks), found(1));
    let chunks: [&[u8]; 4] = [b"data: {\"a\":2}\r", b"\n", b"\r", b"\n"];
    assert_eq!(scan_chunks(&m, Framing::Sse, chunks), found(2));
}

#[test]
fn a_last_event_without_its_blank_line_counts_if_complete() {
    let p = ["/a"];
    assert_eq!(sse(&p, "data: {\"a\":1}\n\ndata: {\"a\":2}"), found(2));
    assert_eq!(sse(&p, "data: {\"a\":1}\n\ndata: {\"a\":2}\n"), found(2));
    assert_eq!(sse(&p, "data: {\"a\":1}\n\ndata: {\"a\":2"), found(1));
    assert_eq!(sse(&p, "data: {\"a\":1}\n\ndata: 3"), found(1));
    assert_eq!(sse(&[""], "data: 1\n\ndata: 3"), found(3));
}

#[test]
fn a_body_past_the_scan_limit_is_over_limit() {
    let mut m = meter(terms(&["/a"]));
    let body = br#"{"a":1}"#;
    m.scan_limit = 7;
    assert_eq!(everywhere(&m, Framing::Json, body), found(1));
    m.scan_limit = 6;
    assert_eq!(everywhere(&m, Framing::Json, body), Usage::OverLimit);
    assert_eq!(
        everywhere(&m, Framing::Sse, b"data: {\"a\":1}\n\n"),
        Usage::OverLimit
    );
    m.scan_limit = 0;
    assert_eq!(whole(&m, Framing::Json, b""), Usage::Missing);
}

#[test]
fn a_meter_without_terms_or_with_unusable_paths_finds_nothing() {
    let m = meter(vec![]);
    assert_eq!(whole(&m, Framing::Json, b"{}"), Usage::Missing);
    let m = meter(vec![Term {
        any_of: vec![],
        weight: 1,
    }]);
    assert_eq!(whole(&m, Framing::Json, b"{}"), Usage::Missing);
    let m = meter(vec![Term {
        any_of: vec![Path(vec![b"a".to_vec(); 17])],
        weight: 1,
    }]);
    let deep = format!("{}1{}", "{\"a\":".repeat(17), "}".repeat(17));
    assert_eq!(whole(&m, Framing::Json, deep.as_bytes()), Usage::Missing);
    // Paths past the 64th are never found; the first 64 are.
    let many: Vec<String> = (0..70).map(|i| format!("/k{i}")).collect();
    let pointers: Vec<&str> = many.iter().map(String::as_str).collect();
    let doc = format!(
        "{{{}}}",
        (0..70)
            .map(|i| format!("\"k{i}\":1"))
            .collect::<Vec<_>>()
            .join(",")
    );
    assert_eq!(
        whole(
            &meter(terms(&pointers[..64])),
            Framing::Json,
            doc.as_bytes()
        ),
        found(64)
    );
    assert_eq!(
        whole(&meter(terms(&pointers)), Framing::Json, doc.as_bytes()),
        Usage::Missing
    );
}

/// Feeds `chunks` (a generator, so nothing big is held) and checks the
/// scan's heap bytes did not change.
fn hostile(m: &Meter, framing: Framing, chunks: impl Iterator<Item = Vec<u8>>) -> Usage {
    let mut scan = Scan::new(m, framing);
    let before = scan.state_bytes();
    assert!(before < 4096, "{before} bytes to start with");
    for chunk in chunks {
        scan.feed(m, &chunk);
    }
    assert_eq!(scan.state_bytes(), before);
    scan.finish(m)
}

#[test]
fn hostile_bodies_keep_the_state_bounded() {
    let m = meter(preset::terms(Preset::OpenaiChat));
    let usage = b"{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}";
    let last = format!("\n\ndata: {}\n\n", String::from_utf8_lossy(usage)).into_bytes();
    // A 1 MiB data line (one JSON string), then the usage.
    let line = std::iter::once(b"data: {\"x\":\"".to_vec())
        .chain(std::iter::repeat_n(vec![b'a'; 1024], 1024))
        .chain([b"\"}".to_vec(), last.clone()]);
    assert_eq!(hostile(&m, Framing::Sse, line), found(3));
    // A 1 MiB line that is not JSON, nor a field.
    let line = std::iter::repeat_n(vec![b'['; 4096], 256).chain([last.clone()]);
    assert_eq!(hostile(&m, Framing::Sse, line), found(3));
    let line = std::iter::repeat_n(b"event".repeat(1000), 256).chain([last.clone()]);
    assert_eq!(hostile(&m, Framing::Sse, line), found(3));
    // 10^5 events.
    let events = std::iter::repeat_n(
        b"data: {\"usage\":null,\"choices\":[{\"d\":\"hi\"}]}\n\n".to_vec(),
        100_000,
    );
    assert_eq!(
        hostile(&m, Framing::Sse, events.chain([last.clone()])),
        found(3)
    );
    // Invalid UTF-8 in keys, strings and between tokens.
    let bad = b"{\"\xff\xfe\":\"\xc3\x28\xed\xa0\x80\",\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}".to_vec();
    assert_eq!(hostile(&m, Framing::Json, [bad].into_iter()), found(3));
    assert_eq!(
        hostile(&m, Framing::Json, [b"{\xff}".to_vec()].into_iter()),
        Usage::Missing
    );
    let noise = (0..=255u8).cycle().take(1 << 16).collect::<Vec<u8>>();
    assert_eq!(
        hostile(&m, Framing::Sse, [noise.clone(), last.clone()].into_iter()),
        found(3)
    );
    assert_eq!(
        hostile(&m, Framing::Json, [noise].into_iter()),
        Usage::Missing
    );
}

/// `{"x":` nested `depth` deep (objects or arrays) around `0`, then the
/// usage beside it.
fn nested(
    depth: usize,
    open: &'static [u8],
    close: &'static [u8],
) -> impl Iterator<Item = Vec<u8>> {
    std::iter::once(b"{\"x\":".to_vec())
        .chain(std::iter::repeat_n(open.to_vec(), depth))
        .chain([b"0".to_vec()])
        .chain(std::iter::repeat_n(close.to_vec(), depth))
        .chain([b",\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}".to_vec()])
}

#[test]
fn deep_nesting_keeps_the_state_bounded() {
    let m = meter(preset::terms(Preset::OpenaiChat));
    for depth in [10_000, 1_000_000] {
        assert_eq!(
            hostile(&m, Framing::Json, nested(depth, b"[", b"]")),
            found(3),
            "{depth}"
        );
        assert_eq!(
            hostile(&m, Framing::Json, nested(depth, b"{\"a\":", b"}")),
            found(3),
            "{depth}"
        );
        assert_eq!(
            hostile(&m, Framing::Json, nested(depth, b"[\"]\",", b"]")),
            found(3),
            "{depth}"
        );
        // Unbalanced: the document never ends.
        let open = nested(depth, b"[", b"").take(depth + 2);
        assert_eq!(hostile(&m, Framing::Json, open), Usage::Missing, "{depth}");
    }
    // Within the checked levels, kinds are checked.
    let crossed = b"{\"x\":[[[{]]]}".to_vec();
    assert_eq!(
        hostile(&m, Framing::Json, [crossed].into_iter()),
        Usage::Missing
    );
}

/// A document with a usage somewhere among random members, as text.
fn document() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_string()),
        Just("true".to_string()),
        (0u64..1_000_000).prop_map(|n| n.to_string()),
        Just("-1.5e3".to_string()),
        "[a-z\\\\\"\u{e9}]{0,6}".prop_map(|s| format!("{s:?}")),
    ];
    let value = leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(" , "))),
            prop::collection::vec(("[a-z_]{1,6}", inner), 0..4).prop_map(|m| {
                let members: Vec<String> = m.iter().map(|(k, v)| format!("{k:?}:{v}")).collect();
                format!("{{ {} }}", members.join(","))
            }),
        ]
    });
    (
        prop::collection::vec(value, 0..4),
        0u64..100_000,
        prop_oneof![
            Just("1".to_string()),
            Just("\"2\"".to_string()),
            (0u64..9).prop_map(|n| n.to_string())
        ],
        0usize..4,
    )
        .prop_map(|(others, total, prompt, at)| {
            let mut members: Vec<String> = others
                .iter()
                .enumerate()
                .map(|(i, v)| format!("\"m{i}\":{v}"))
                .collect();
            let usage =
                format!("\"usage\":{{\"total_tokens\":{total},\"prompt_\\u0074okens\":{prompt}}}");
            members.insert(at.min(members.len()), usage);
            format!("{{{}}}", members.join(","))
        })
}

proptest! {
    #[test]
    fn chunking_never_changes_the_usage(
        doc in document(),
        cuts in prop::collection::vec(0usize..400, 0..8),
        size in 1usize..16,
    ) {
        let m = meter(terms(&["/usage/total_tokens", "/usage/prompt_tokens"]));
        let body = doc.as_bytes();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(body.len())).collect();
        cuts.sort_unstable();
        let mut chunks = Vec::new();
        let mut from = 0;
        for c in cuts.into_iter().chain([body.len()]) {
            chunks.push(&body[from..c]);
            from = c;
        }
        let expected = whole(&m, Framing::Json, body);
        prop_assert!(expected != Usage::Missing || doc.contains("\"2\""), "{doc}: {expected:?}");
        prop_assert_eq!(scan_chunks(&m, Framing::Json, chunks.iter().copied()), expected);
        // The same document as one event of a stream (its data on two
        // lines where it has a space), in chunks of `size` bytes.
        let stream = format!("data: {}\r\n\r\n", doc.replacen(' ', "\r\ndata:", 1));
        let events = scan_chunks(&m, Framing::Sse, stream.as_bytes().chunks(size));
        prop_assert_eq!(events, expected);
    }
}
