use super::*;
use proptest::prelude::*;

fn ptr(s: &str) -> Vec<String> {
    crate::config::JsonPointer::parse(s).unwrap().0
}

fn read(body: &str, pointer: &str, cap: u64) -> Reserved {
    reserve(&Body::parse(Some(body.as_bytes())), &ptr(pointer), cap)
}

fn rewrite(body: &str) -> Rewrite {
    ensure_stream_usage(&Body::parse(Some(body.as_bytes())), body.as_bytes())
}

fn rewritten(body: &str) -> String {
    match rewrite(body) {
        Rewrite::Body(b) => String::from_utf8(b).unwrap(),
        other => panic!("{body}: {other:?}"),
    }
}

#[test]
fn the_reservation_is_the_whole_number_at_the_pointer_capped() {
    assert_eq!(
        read(r#"{"max_tokens": 500}"#, "/max_tokens", 16000),
        Reserved::Read(500)
    );
    assert_eq!(
        read(r#"{"max_tokens": 500.0}"#, "/max_tokens", 16000),
        Reserved::Read(500)
    );
    assert_eq!(
        read(r#"{"max_tokens": 5e2}"#, "/max_tokens", 16000),
        Reserved::Read(500)
    );
    assert_eq!(
        read(r#"{"max_tokens": 99999}"#, "/max_tokens", 16000),
        Reserved::Read(16000)
    );
    assert_eq!(
        read(r#"{"max_tokens": 18446744073709551615}"#, "/max_tokens", 7),
        Reserved::Read(7)
    );
    assert_eq!(
        read(
            r#"{"max_tokens": 1000000000000000000000000000000}"#,
            "/max_tokens",
            7
        ),
        Reserved::Read(7)
    );
    assert_eq!(
        read(r#"{"max_tokens": 1e308}"#, "/max_tokens", 7),
        Reserved::Read(7)
    );
    assert_eq!(
        read(r#"{"a": [{"b~/c": 3}, {"b~/c": 4}]}"#, "/a/1/b~0~1c", 9),
        Reserved::Read(4)
    );
}

#[test]
fn anything_but_a_whole_number_of_at_least_one_reserves_the_default() {
    for body in [
        r#"{"max_tokens": 0}"#,
        r#"{"max_tokens": -5}"#,
        r#"{"max_tokens": 2.5}"#,
        r#"{"max_tokens": 0.5}"#,
        r#"{"max_tokens": -1e308}"#,
        r#"{"max_tokens": "500"}"#,
        r#"{"max_tokens": null}"#,
        r#"{"max_tokens": [500]}"#,
        r#"{"max_tokens": {"n": 500}}"#,
        r#"{"max_token": 500}"#,
        r#"{"nested": {"max_tokens": 500}}"#,
        r#"[500]"#,
        r#"500"#,
    ] {
        assert_eq!(read(body, "/max_tokens", 100), Reserved::Default, "{body}");
    }
    // Array indices as RFC 6901 has them: no leading zero, no sign.
    assert_eq!(read(r#"{"a": [1, 2]}"#, "/a/01", 9), Reserved::Default);
    assert_eq!(read(r#"{"a": [1, 2]}"#, "/a/-1", 9), Reserved::Default);
    assert_eq!(read(r#"{"a": [1, 2]}"#, "/a/2", 9), Reserved::Default);
}

#[test]
fn a_body_that_is_absent_too_large_or_not_json_reserves_the_default() {
    assert_eq!(Body::parse(None), Body::TooLarge);
    assert_eq!(Body::parse(Some(b"{\"max_tokens\": 5")), Body::NotJson);
    assert_eq!(Body::parse(Some(b"")), Body::NotJson);
    assert_eq!(Body::parse(Some(b"\xff\xfe")), Body::NotJson);
    for body in [Body::Absent, Body::TooLarge, Body::NotJson] {
        assert_eq!(reserve(&body, &ptr("/max_tokens"), 9), Reserved::Default);
    }
    // Nesting past serde_json's recursion limit is refused, not recursed into.
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    assert_eq!(Body::parse(Some(deep.as_bytes())), Body::NotJson);
}

#[test]
fn a_stream_without_usage_gets_include_usage_and_nothing_else_changes() {
    assert_eq!(
        rewritten(r#"{"model":"m","stream":true,"max_tokens":1.50e2}"#),
        r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"max_tokens":1.50e2}"#
    );
    assert_eq!(
        rewritten(" \n{ \"stream\" : true }\n"),
        " \n{\"stream_options\":{\"include_usage\":true}, \"stream\" : true }\n"
    );
    // Merged into an existing object, its other members kept.
    assert_eq!(
        rewritten(r#"{"stream":true,"stream_options":{"x":[1,{"include_usage":false}]}}"#),
        r#"{"stream":true,"stream_options":{"include_usage":true,"x":[1,{"include_usage":false}]}}"#
    );
    assert_eq!(
        rewritten(r#"{"stream":true,"stream_options":{ }}"#),
        r#"{"stream":true,"stream_options":{"include_usage":true }}"#
    );
    // A client turning it off gets it on: its stream would charge only the reservation.
    assert_eq!(
        rewritten(r#"{"stream":true,"stream_options":{"include_usage" : false, "y":"}"}}"#),
        r#"{"stream":true,"stream_options":{"include_usage" : true, "y":"}"}}"#
    );
    assert_eq!(
        rewritten(r#"{"stream":true,"stream_options":{"include_usage":null}}"#),
        r#"{"stream":true,"stream_options":{"include_usage":true}}"#
    );
    // Keys written with escapes, and strings holding brackets and quotes.
    assert_eq!(
        rewritten(r#"{"s\"]}":"{[","stream":true,"stream\u005foptions":{"a":"\\"}}"#),
        r#"{"s\"]}":"{[","stream":true,"stream\u005foptions":{"include_usage":true,"a":"\\"}}"#
    );
    // Duplicate keys: the last one is the one parsers keep, and the one changed.
    assert_eq!(
        rewritten(r#"{"stream":true,"stream_options":{},"stream_options":{"n":1}}"#),
        r#"{"stream":true,"stream_options":{},"stream_options":{"include_usage":true,"n":1}}"#
    );
    let out = rewritten(r#"{"stream":true,"stream_options":{"include_usage":0}}"#);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["stream_options"]["include_usage"], Value::Bool(true));
}

#[test]
fn a_body_with_nothing_to_ask_or_that_cannot_be_read_is_left_as_it_is() {
    for body in [
        r#"{"stream":false}"#,
        r#"{"stream":"true"}"#,
        r#"{"model":"m"}"#,
        r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
        r#"[{"stream":true}]"#,
        r#"true"#,
    ] {
        assert_eq!(rewrite(body), Rewrite::Unneeded, "{body}");
    }
    for body in [
        r#"{"stream":true,"stream_options":null}"#,
        r#"{"stream":true,"stream_options":[]}"#,
        r#"{"stream":true"#,
    ] {
        assert_eq!(rewrite(body), Rewrite::Unchanged, "{body}");
    }
    assert_eq!(
        ensure_stream_usage(&Body::TooLarge, b""),
        Rewrite::Unchanged
    );
    assert_eq!(ensure_stream_usage(&Body::Absent, b""), Rewrite::Unneeded);
}

#[test]
fn the_member_splitter_refuses_what_is_not_an_object() {
    assert_eq!(members(b"[1]", 0), None);
    assert_eq!(members(b"{\"a\" 1}", 0), None);
    assert_eq!(members(b"{\"a\":1", 0), None);
    assert_eq!(members(b"{\"a", 0), None);
    let text = br#"{"a":[1,{"b":"]"}], "c" : -2e5 }"#;
    let spans: Vec<(String, &[u8])> = members(text, 0)
        .unwrap()
        .into_iter()
        .map(|(k, r)| (k, &text[r]))
        .collect();
    assert_eq!(
        spans,
        [
            ("a".to_string(), &br#"[1,{"b":"]"}]"#[..]),
            ("c".to_string(), &b"-2e5"[..])
        ]
    );
}

/// Any JSON value, its strings and keys full of what the splicer must skip
/// (quotes, backslashes, brackets, commas) and of the keys it looks for.
fn arb_value() -> impl Strategy<Value = Value> {
    let text = prop_oneof![
        Just("stream".to_string()),
        Just("stream_options".to_string()),
        Just("include_usage".to_string()),
        "[a-z\"\\\\{}\\[\\],: ]{0,6}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        text.clone().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 24, 4, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((text.clone(), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    /// Whatever the body, a rewrite is valid JSON that parses to the body
    /// with `stream_options.include_usage: true` and nothing else changed;
    /// no rewrite is asked for a body that needs none; nothing panics.
    #[test]
    fn a_rewrite_changes_exactly_include_usage(
        mut doc in arb_value(),
        stream in any::<bool>(),
        pretty in any::<bool>(),
    ) {
        if let (Value::Object(m), true) = (&mut doc, stream) {
            m.insert("stream".into(), Value::Bool(true));
        }
        let bytes = if pretty {
            serde_json::to_vec_pretty(&doc).unwrap()
        } else {
            serde_json::to_vec(&doc).unwrap()
        };
        let body = Body::parse(Some(&bytes));
        prop_assert_eq!(&body, &Body::Json(doc.clone()));
        let asks = doc.get("stream") == Some(&Value::Bool(true));
        let options = doc.get(STREAM_OPTIONS);
        match ensure_stream_usage(&body, &bytes) {
            Rewrite::Body(out) => {
                prop_assert!(asks);
                let mut want = doc.clone();
                let o = want
                    .as_object_mut()
                    .unwrap()
                    .entry(STREAM_OPTIONS)
                    .or_insert_with(|| Value::Object(Default::default()));
                o.as_object_mut()
                    .unwrap()
                    .insert(INCLUDE_USAGE.into(), Value::Bool(true));
                let got: Value = serde_json::from_slice(&out).unwrap();
                prop_assert_eq!(got, want);
            }
            Rewrite::Unneeded => prop_assert!(
                !asks || options.and_then(|o| o.get(INCLUDE_USAGE)) == Some(&Value::Bool(true))
            ),
            Rewrite::Unchanged => prop_assert!(asks && !options.is_some_and(Value::is_object)),
        }
    }
}
