//! The rate-limit response headers read as a client reads them: `RateLimit`
//! and `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-11) by a real
//! RFC 9651 parser (the `sfv` crate), each a List of Items whose value is a
//! String and whose parameters are the draft's; the numbers (`Retry-After`,
//! `X-RateLimit-*`) as sf-integers. Each field must also be in its canonical
//! serialization, so that an exact string comparison and a parser agree.

use anyhow::{anyhow, bail, ensure, Result};
use sfv::{BareItem, FieldType, Item, List, ListEntry, Parser};

/// One `RateLimit-Policy` item: a quota policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The policy's name (the item's String).
    pub name: String,
    /// `q`: the quota.
    pub q: i64,
    /// `qu`: the quota unit, absent for the default (`requests`).
    pub qu: Option<String>,
    /// `w`: the window in seconds.
    pub w: Option<i64>,
}

/// One `RateLimit` item: a policy's service limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// The policy's name.
    pub name: String,
    /// `r`: the quota available.
    pub r: i64,
    /// `t`: the effective window in seconds.
    pub t: Option<i64>,
}

/// A `RateLimit-Policy` value, or why a client would find it malformed.
pub fn policies(value: &str) -> Result<Vec<Policy>> {
    items(value)?
        .into_iter()
        .map(|(name, params)| {
            let mut p = Policy {
                name,
                q: -1,
                qu: None,
                w: None,
            };
            for (key, v) in params {
                match key.as_str() {
                    "q" => p.q = non_negative(&key, &v)?,
                    "qu" => p.qu = Some(string(&key, &v)?),
                    "w" => {
                        let w = non_negative(&key, &v)?;
                        ensure!(w > 0, "a window of 0 in {value:?}");
                        p.w = Some(w);
                    }
                    other => bail!("unexpected parameter {other:?} in {value:?}"),
                }
            }
            ensure!(p.q >= 0, "policy {:?} without q in {value:?}", p.name);
            Ok(p)
        })
        .collect()
}

/// A `RateLimit` value, or why a client would find it malformed.
pub fn limits(value: &str) -> Result<Vec<Limit>> {
    items(value)?
        .into_iter()
        .map(|(name, params)| {
            let mut l = Limit {
                name,
                r: -1,
                t: None,
            };
            for (key, v) in params {
                match key.as_str() {
                    "r" => l.r = non_negative(&key, &v)?,
                    "t" => l.t = Some(non_negative(&key, &v)?),
                    other => bail!("unexpected parameter {other:?} in {value:?}"),
                }
            }
            ensure!(l.r >= 0, "limit {:?} without r in {value:?}", l.name);
            Ok(l)
        })
        .collect()
}

/// A field holding one non-negative sf-integer (`Retry-After`'s
/// delay-seconds, the `X-RateLimit-*` numbers).
pub fn integer(value: &str) -> Result<i64> {
    let item: Item = Parser::new(value)
        .parse()
        .map_err(|e| anyhow!("{value:?} is not a structured item: {e}"))?;
    ensure!(item.params.is_empty(), "{value:?} has parameters");
    canonical(value, item.serialize())?;
    non_negative("value", &item.bare_item)
}

/// An item's name and its parameters, in order.
type Named = (String, Vec<(String, BareItem)>);

/// The List's Items, each a String with its parameters in order; an inner
/// list, another bare item, a duplicate name or a non-canonical value fails.
fn items(value: &str) -> Result<Vec<Named>> {
    let list: List = Parser::new(value)
        .parse()
        .map_err(|e| anyhow!("{value:?} is not a structured List: {e}"))?;
    ensure!(!list.is_empty(), "an empty List");
    canonical(value, list.serialize().unwrap_or_default())?;
    let mut out: Vec<Named> = Vec::new();
    for entry in list {
        let ListEntry::Item(item) = entry else {
            bail!("an inner list in {value:?}");
        };
        let name = item
            .bare_item
            .as_string()
            .ok_or_else(|| anyhow!("{:?} is not a String in {value:?}", item.bare_item))?
            .as_str()
            .to_owned();
        ensure!(
            out.iter().all(|(n, _)| !n.eq_ignore_ascii_case(&name)),
            "policy {name:?} twice in {value:?}"
        );
        let params = item
            .params
            .into_iter()
            .map(|(k, v)| (k.as_str().to_owned(), v))
            .collect();
        out.push((name, params));
    }
    Ok(out)
}

fn canonical(value: &str, serialized: String) -> Result<()> {
    ensure!(
        serialized == value,
        "{value:?} is not in canonical form ({serialized:?})"
    );
    Ok(())
}

fn non_negative(key: &str, v: &BareItem) -> Result<i64> {
    let n = v
        .as_integer()
        .map(i64::from)
        .ok_or_else(|| anyhow!("{key} is not an Integer: {v:?}"))?;
    ensure!(n >= 0, "{key} is negative: {n}");
    Ok(n)
}

fn string(key: &str, v: &BareItem) -> Result<String> {
    v.as_string()
        .map(|s| s.as_str().to_owned())
        .ok_or_else(|| anyhow!("{key} is not a String: {v:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drafts_examples_read_and_malformed_fields_do_not() {
        let p = policies(r#""permin";q=50;w=60, "perhr";q=1000;w=3600"#).unwrap();
        assert_eq!(
            p,
            [
                Policy {
                    name: "permin".into(),
                    q: 50,
                    qu: None,
                    w: Some(60)
                },
                Policy {
                    name: "perhr".into(),
                    q: 1000,
                    qu: None,
                    w: Some(3600)
                },
            ]
        );
        let l = limits(r#""default";r=50;t=30"#).unwrap();
        assert_eq!(
            l,
            [Limit {
                name: "default".into(),
                r: 50,
                t: Some(30)
            }]
        );
        for bad in [
            "",
            "default;q=1",         // a Token, not a String
            r#""a";q=1,"b";q=2"#,  // not canonical (no space)
            r#""a";w=60"#,         // no q
            r#""a";q=-1"#,         // negative
            r#""a";q=1, "A";q=2"#, // one name twice
            r#"("a" "b");q=1"#,    // an inner list
            r#""a";q=1;w=0"#,      // a window of 0
        ] {
            assert!(policies(bad).is_err(), "{bad:?} read");
        }
        assert_eq!(integer("360").unwrap(), 360);
        assert!(integer("3.5").is_err() && integer("-1").is_err() && integer("1;x").is_err());
    }
}
