//! proxy-wasm wire formats: header "pairs" and property paths.

/// Header map / pairs: `u32 count`, then `count` times `(u32 key_len, u32 value_len)`, then
/// for each pair `key \0 value \0`. All integers little-endian.
pub fn serialize_pairs(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in pairs {
        size += 8 + k.len() + v.len() + 2;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Parses the pairs serialization. Keys are returned as (lossy) UTF-8 strings; values as bytes.
pub fn deserialize_pairs(data: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    if data.is_empty() {
        return Ok(Vec::new());
    }
    let rd = |at: usize| -> Result<usize, String> {
        data.get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)
            .ok_or_else(|| format!("pairs truncated at byte {at} of {}", data.len()))
    };
    let count = rd(0)?;
    if count > data.len() / 8 {
        return Err(format!(
            "pairs count {count} too large for {} bytes",
            data.len()
        ));
    }
    let mut sizes = Vec::with_capacity(count);
    for i in 0..count {
        sizes.push((rd(4 + i * 8)?, rd(8 + i * 8)?));
    }
    let mut at = 4 + count * 8;
    let mut out = Vec::with_capacity(count);
    for (klen, vlen) in sizes {
        let key = data
            .get(at..at + klen)
            .ok_or_else(|| format!("pairs key truncated at byte {at}"))?;
        at += klen;
        if data.get(at) != Some(&0) {
            return Err(format!("pairs key not NUL-terminated at byte {at}"));
        }
        at += 1;
        let value = data
            .get(at..at + vlen)
            .ok_or_else(|| format!("pairs value truncated at byte {at}"))?;
        at += vlen;
        if data.get(at) != Some(&0) {
            return Err(format!("pairs value not NUL-terminated at byte {at}"));
        }
        at += 1;
        out.push((String::from_utf8_lossy(key).into_owned(), value.to_vec()));
    }
    Ok(out)
}

/// A property path arrives as its parts separated by NUL bytes (a trailing NUL is tolerated).
pub fn split_property_path(data: &[u8]) -> Vec<String> {
    let mut data = data;
    if data.last() == Some(&0) {
        data = &data[..data.len() - 1];
    }
    if data.is_empty() {
        return Vec::new();
    }
    data.split(|b| *b == 0)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect()
}
