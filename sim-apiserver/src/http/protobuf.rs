//! Request bodies in the Kubernetes protobuf encoding, for the kinds that
//! typed Go clients (client-go clientsets, and so Helm's release storage)
//! write in it: `Secret`, `ConfigMap` and `DeleteOptions` here, and the
//! kinds `kubectl create <kind>` sends in `protobuf_kinds`. Each is decoded
//! into the JSON object the rest of the server handles; any other kind is
//! refused with 415 naming it. Responses stay JSON, which those clients
//! accept as well.
//!
//! The encoding: the magic `k8s\0`, then a `runtime.Unknown` message whose
//! `raw` field holds the object's own message; field numbers are those of
//! the upstream `generated.proto` files.

use serde_json::{Map, Value, json};

use crate::error::{ApiError, Reason};
use crate::util::{base64_encode, format_ts};

/// The media type of the protobuf encoding.
pub const CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";

const MAGIC: &[u8] = b"k8s\0";

/// One field of a message as it is on the wire.
pub(super) enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self
                .buf
                .split_first()
                .ok_or("truncated varint in protobuf body")?;
            self.buf = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint longer than 10 bytes in protobuf body".into())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err("truncated field in protobuf body".into());
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next field, or None at the end of the message.
    fn next(&mut self) -> Result<Option<(u64, Wire<'a>)>, String> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let wire = match key & 7 {
            0 => Wire::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Wire::Fixed
            }
            2 => {
                let n = usize::try_from(self.varint()?)
                    .map_err(|_| "field length overflows".to_string())?;
                Wire::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Wire::Fixed
            }
            t => return Err(format!("unsupported protobuf wire type {t}")),
        };
        Ok(Some((key >> 3, wire)))
    }
}

/// Calls `f` with every field of a message.
pub(super) fn fields<'a>(
    buf: &'a [u8],
    mut f: impl FnMut(u64, Wire<'a>) -> Result<(), String>,
) -> Result<(), String> {
    let mut r = Reader { buf };
    // Each step consumes at least one byte, so this ends.
    while let Some((n, w)) = r.next()? {
        f(n, w)?;
    }
    Ok(())
}

pub(super) fn string(w: Wire<'_>) -> Result<String, String> {
    match w {
        Wire::Bytes(b) => String::from_utf8(b.to_vec())
            .map_err(|_| "a string field is not UTF-8 in protobuf body".to_string()),
        _ => Err("a string field has the wrong wire type in protobuf body".into()),
    }
}

pub(super) fn bytes<'a>(w: Wire<'a>) -> Result<&'a [u8], String> {
    match w {
        Wire::Bytes(b) => Ok(b),
        _ => Err("a message field has the wrong wire type in protobuf body".into()),
    }
}

pub(super) fn int(w: Wire<'_>) -> Result<i64, String> {
    match w {
        // int64 fields carry two's complement in the varint.
        Wire::Varint(v) => Ok(v as i64),
        _ => Err("an integer field has the wrong wire type in protobuf body".into()),
    }
}

/// A `map<string, V>` entry: key 1, value 2.
pub(super) fn map_entry(w: Wire<'_>) -> Result<(String, &[u8]), String> {
    let mut key = String::new();
    let mut value: &[u8] = &[];
    fields(bytes(w)?, |n, w| {
        match n {
            1 => key = string(w)?,
            2 => value = bytes(w)?,
            _ => {}
        }
        Ok(())
    })?;
    Ok((key, value))
}

pub(super) fn utf8(b: &[u8]) -> Result<String, String> {
    String::from_utf8(b.to_vec()).map_err(|_| "a map value is not UTF-8".to_string())
}

fn time(w: Wire<'_>) -> Result<String, String> {
    let mut secs = 0i64;
    fields(bytes(w)?, |n, w| {
        if n == 1 {
            secs = int(w)?;
        }
        Ok(())
    })?;
    jiff::Timestamp::from_second(secs)
        .map(format_ts)
        .map_err(|e| format!("bad timestamp in protobuf body: {e}"))
}

fn owner_reference(w: Wire<'_>) -> Result<Value, String> {
    let mut o = Map::new();
    fields(bytes(w)?, |n, w| {
        let (k, v) = match n {
            1 => ("kind", json!(string(w)?)),
            3 => ("name", json!(string(w)?)),
            4 => ("uid", json!(string(w)?)),
            5 => ("apiVersion", json!(string(w)?)),
            6 => ("controller", json!(int(w)? != 0)),
            7 => ("blockOwnerDeletion", json!(int(w)? != 0)),
            _ => return Ok(()),
        };
        o.insert(k.into(), v);
        Ok(())
    })?;
    Ok(Value::Object(o))
}

/// `ObjectMeta` (managed fields are not kept, as for JSON writes).
pub(super) fn object_meta(w: Wire<'_>) -> Result<Value, String> {
    let mut m = Map::new();
    let mut labels = Map::new();
    let mut annotations = Map::new();
    let mut owners = Vec::new();
    let mut finalizers = Vec::new();
    fields(bytes(w)?, |n, w| {
        match n {
            1 => {
                m.insert("name".into(), json!(string(w)?));
            }
            2 => {
                m.insert("generateName".into(), json!(string(w)?));
            }
            3 => {
                m.insert("namespace".into(), json!(string(w)?));
            }
            5 => {
                m.insert("uid".into(), json!(string(w)?));
            }
            6 => {
                m.insert("resourceVersion".into(), json!(string(w)?));
            }
            7 => {
                m.insert("generation".into(), json!(int(w)?));
            }
            8 => {
                m.insert("creationTimestamp".into(), json!(time(w)?));
            }
            9 => {
                m.insert("deletionTimestamp".into(), json!(time(w)?));
            }
            10 => {
                m.insert("deletionGracePeriodSeconds".into(), json!(int(w)?));
            }
            11 => {
                let (k, v) = map_entry(w)?;
                labels.insert(k, json!(utf8(v)?));
            }
            12 => {
                let (k, v) = map_entry(w)?;
                annotations.insert(k, json!(utf8(v)?));
            }
            13 => owners.push(owner_reference(w)?),
            14 => finalizers.push(json!(string(w)?)),
            _ => {}
        }
        Ok(())
    })?;
    if !labels.is_empty() {
        m.insert("labels".into(), Value::Object(labels));
    }
    if !annotations.is_empty() {
        m.insert("annotations".into(), Value::Object(annotations));
    }
    if !owners.is_empty() {
        m.insert("ownerReferences".into(), Value::Array(owners));
    }
    if !finalizers.is_empty() {
        m.insert("finalizers".into(), Value::Array(finalizers));
    }
    Ok(Value::Object(m))
}

/// `Secret`: data values are bytes, rendered base64 as in JSON.
fn secret(raw: &[u8]) -> Result<Value, String> {
    let mut o = Map::new();
    let mut data = Map::new();
    let mut string_data = Map::new();
    fields(raw, |n, w| {
        match n {
            1 => {
                o.insert("metadata".into(), object_meta(w)?);
            }
            2 => {
                let (k, v) = map_entry(w)?;
                data.insert(k, json!(base64_encode(v)));
            }
            3 => {
                // Go's protobuf writes an unset type as ""; the server
                // then defaults it, as for JSON without one.
                let t = string(w)?;
                if !t.is_empty() {
                    o.insert("type".into(), json!(t));
                }
            }
            4 => {
                let (k, v) = map_entry(w)?;
                string_data.insert(k, json!(utf8(v)?));
            }
            5 => {
                o.insert("immutable".into(), json!(int(w)? != 0));
            }
            _ => {}
        }
        Ok(())
    })?;
    if !data.is_empty() {
        o.insert("data".into(), Value::Object(data));
    }
    if !string_data.is_empty() {
        o.insert("stringData".into(), Value::Object(string_data));
    }
    Ok(Value::Object(o))
}

fn config_map(raw: &[u8]) -> Result<Value, String> {
    let mut o = Map::new();
    let mut data = Map::new();
    let mut binary = Map::new();
    fields(raw, |n, w| {
        match n {
            1 => {
                o.insert("metadata".into(), object_meta(w)?);
            }
            2 => {
                let (k, v) = map_entry(w)?;
                data.insert(k, json!(utf8(v)?));
            }
            3 => {
                let (k, v) = map_entry(w)?;
                binary.insert(k, json!(base64_encode(v)));
            }
            4 => {
                o.insert("immutable".into(), json!(int(w)? != 0));
            }
            _ => {}
        }
        Ok(())
    })?;
    if !data.is_empty() {
        o.insert("data".into(), Value::Object(data));
    }
    if !binary.is_empty() {
        o.insert("binaryData".into(), Value::Object(binary));
    }
    Ok(Value::Object(o))
}

fn delete_options(raw: &[u8]) -> Result<Value, String> {
    let mut o = Map::new();
    let mut dry_run = Vec::new();
    fields(raw, |n, w| {
        match n {
            1 => {
                o.insert("gracePeriodSeconds".into(), json!(int(w)?));
            }
            2 => {
                let mut p = Map::new();
                fields(bytes(w)?, |n, w| {
                    match n {
                        1 => {
                            p.insert("uid".into(), json!(string(w)?));
                        }
                        2 => {
                            p.insert("resourceVersion".into(), json!(string(w)?));
                        }
                        _ => {}
                    }
                    Ok(())
                })?;
                o.insert("preconditions".into(), Value::Object(p));
            }
            3 => {
                o.insert("orphanDependents".into(), json!(int(w)? != 0));
            }
            4 => {
                o.insert("propagationPolicy".into(), json!(string(w)?));
            }
            5 => dry_run.push(json!(string(w)?)),
            _ => {}
        }
        Ok(())
    })?;
    if !dry_run.is_empty() {
        o.insert("dryRun".into(), Value::Array(dry_run));
    }
    Ok(Value::Object(o))
}

/// Decodes a protobuf request body into its JSON form (with `apiVersion`
/// and `kind` from the envelope).
pub fn decode(body: &[u8]) -> Result<Value, ApiError> {
    let bad = |m: String| ApiError::bad_request(format!("cannot decode the protobuf body: {m}"));
    let inner = body
        .strip_prefix(MAGIC)
        .ok_or_else(|| bad("it does not start with the k8s protobuf magic".into()))?;
    let mut api_version = String::new();
    let mut kind = String::new();
    let mut raw: &[u8] = &[];
    fields(inner, |n, w| {
        match n {
            1 => fields(bytes(w)?, |n, w| {
                match n {
                    1 => api_version = string(w)?,
                    2 => kind = string(w)?,
                    _ => {}
                }
                Ok(())
            })?,
            2 => raw = bytes(w)?,
            _ => {}
        }
        Ok(())
    })
    .map_err(bad)?;
    let mut obj = match kind.as_str() {
        "Secret" => secret(raw),
        "ConfigMap" => config_map(raw),
        "DeleteOptions" => delete_options(raw),
        other => match super::protobuf_kinds::message_of(other) {
            Some(message) => super::protobuf_kinds::decode(raw, message),
            None => {
                return Err(ApiError::new(
                    Reason::UnsupportedMediaType,
                    format!(
                        "the simulated API server decodes protobuf only for Secret, ConfigMap, DeleteOptions, {}, not {kind:?}; send application/json",
                        super::protobuf_kinds::KINDS
                    ),
                ));
            }
        },
    }
    .map_err(bad)?;
    if let Some(o) = obj.as_object_mut() {
        if !api_version.is_empty() {
            o.insert("apiVersion".into(), json!(api_version));
        }
        o.insert("kind".into(), json!(kind));
    }
    Ok(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn field(n: u64, payload: &[u8], out: &mut Vec<u8>) {
        varint(n << 3 | 2, out);
        varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }

    fn entry(k: &str, v: &[u8]) -> Vec<u8> {
        let mut e = Vec::new();
        field(1, k.as_bytes(), &mut e);
        field(2, v, &mut e);
        e
    }

    fn envelope(kind: &str, raw: &[u8]) -> Vec<u8> {
        let mut tm = Vec::new();
        field(1, b"v1", &mut tm);
        field(2, kind.as_bytes(), &mut tm);
        let mut body = MAGIC.to_vec();
        field(1, &tm, &mut body);
        field(2, raw, &mut body);
        body
    }

    #[test]
    fn secrets_decode_with_metadata_and_binary_data() {
        let mut meta = Vec::new();
        field(1, b"sh.helm.release.v1.x.v1", &mut meta);
        field(3, b"ns", &mut meta);
        field(11, &entry("owner", b"helm"), &mut meta);
        let mut t = Vec::new();
        varint(1 << 3, &mut t);
        varint(1_700_000_000, &mut t);
        field(8, &t, &mut meta);
        field(14, b"f", &mut meta);
        let mut s = Vec::new();
        field(1, &meta, &mut s);
        field(2, &entry("release", &[0, 1, 2, 255]), &mut s);
        field(3, b"helm.sh/release.v1", &mut s);
        let v = decode(&envelope("Secret", &s)).expect("decodes");
        assert_eq!(
            v,
            json!({
                "apiVersion": "v1", "kind": "Secret", "type": "helm.sh/release.v1",
                "metadata": {"name": "sh.helm.release.v1.x.v1", "namespace": "ns",
                    "labels": {"owner": "helm"}, "creationTimestamp": "2023-11-14T22:13:20Z",
                    "finalizers": ["f"]},
                "data": {"release": base64_encode(&[0, 1, 2, 255])},
            })
        );
    }

    #[test]
    fn delete_options_and_config_maps_decode() {
        let mut d = Vec::new();
        varint(1 << 3, &mut d);
        varint(0, &mut d);
        field(4, b"Foreground", &mut d);
        let v = decode(&envelope("DeleteOptions", &d)).expect("decodes");
        assert_eq!(v["gracePeriodSeconds"], 0);
        assert_eq!(v["propagationPolicy"], "Foreground");
        let mut c = Vec::new();
        field(2, &entry("k", b"v"), &mut c);
        let v = decode(&envelope("ConfigMap", &c)).expect("decodes");
        assert_eq!(v["data"]["k"], "v");
    }

    #[test]
    fn other_kinds_and_garbage_are_refused() {
        let e = decode(&envelope("PersistentVolume", &[])).expect_err("not decoded");
        assert_eq!(e.http_code(), 415);
        assert!(e.message.contains("\"PersistentVolume\""), "{}", e.message);
        assert_eq!(decode(b"{}").expect_err("no magic").http_code(), 400);
        let mut truncated = MAGIC.to_vec();
        truncated.extend_from_slice(&[0x12, 0x05, 0x01]);
        assert_eq!(decode(&truncated).expect_err("truncated").http_code(), 400);
    }
}
