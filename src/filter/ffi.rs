//! The proxy-wasm ABI calls the adapter makes, imported directly instead of through
//! `proxy_wasm::hostcalls`: the SDK's wrappers panic on any status they do not expect and
//! `get_map_value` panics on a header value that is not UTF-8 (an h2c `:path` can carry any
//! byte). Here every status other than `Ok` becomes an error, values stay bytes, and an
//! unknown status code is read as a `u32` rather than transmuted into the SDK's enum.

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};
use std::ptr::{null, null_mut};

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, data: *const u8, size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(ret: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        kind: u32,
        start: usize,
        max: usize,
        ret_data: *mut *mut u8,
        ret_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        ret_data: *mut *mut u8,
        ret_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(map: u32, ret_data: *mut *mut u8, ret_size: *mut usize) -> u32;
    fn proxy_replace_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map: u32, key: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path: *const u8,
        path_size: usize,
        ret_data: *mut *mut u8,
        ret_size: *mut usize,
    ) -> u32;
    fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_size: usize, ret_id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
    fn proxy_get_metric(id: u32, ret_value: *mut u64) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        ret_data: *mut *mut u8,
        ret_size: *mut usize,
        ret_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_register_shared_queue(name: *const u8, name_size: usize, ret_id: *mut u32) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id: *const u8,
        vm_id_size: usize,
        name: *const u8,
        name_size: usize,
        ret_id: *mut u32,
    ) -> u32;
    fn proxy_dequeue_shared_queue(id: u32, ret_data: *mut *mut u8, ret_size: *mut usize) -> u32;
    fn proxy_enqueue_shared_queue(id: u32, value: *const u8, value_size: usize) -> u32;
    fn proxy_grpc_send(token: u32, message: *const u8, message_size: usize, end_stream: u32)
        -> u32;
    fn proxy_grpc_cancel(token: u32) -> u32;
}

/// The ABI's status codes (proxy-wasm spec), as far as the adapter tells them apart.
const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const EMPTY: u32 = 7;
const CAS_MISMATCH: u32 = 8;

fn status(code: u32) -> Result<(), Status> {
    match code {
        OK => Ok(()),
        NOT_FOUND => Err(Status::NotFound),
        2 => Err(Status::BadArgument),
        3 => Err(Status::SerializationFailure),
        4 => Err(Status::ParseFailure),
        EMPTY => Err(Status::Empty),
        CAS_MISMATCH => Err(Status::CasMismatch),
        _ => Err(Status::InternalFailure),
    }
}

/// Takes ownership of a buffer the host allocated through the SDK's
/// `proxy_on_memory_allocate` (a `Vec<u8>` of exactly `size` bytes).
///
/// # Safety
/// `data` is null or was returned by the host for this call with length `size`.
unsafe fn take(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        None
    } else {
        Some(Vec::from_raw_parts(data, size, size))
    }
}

/// A returned value, or `None` for `NotFound`.
fn found(code: u32, data: *mut u8, size: usize) -> Result<Option<Vec<u8>>, Status> {
    match status(code) {
        // SAFETY: the host filled `data`/`size` for this call.
        Ok(()) => Ok(unsafe { take(data, size) }),
        Err(Status::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

pub fn log(level: LogLevel, msg: &str) -> Result<(), Status> {
    // SAFETY: the pointers are valid for the lengths given; the host only reads them.
    status(unsafe { proxy_log(level as u32, msg.as_ptr(), msg.len()) })
}

pub fn now_ns() -> Result<u64, Status> {
    let mut t = 0u64;
    // SAFETY: `t` outlives the call.
    status(unsafe { proxy_get_current_time_nanoseconds(&mut t) })?;
    Ok(t)
}

pub fn set_tick_period_ms(ms: u32) -> Result<(), Status> {
    // SAFETY: no pointers.
    status(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

pub fn buffer(kind: BufferType, start: usize, max: usize) -> Result<Option<Vec<u8>>, Status> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: out-pointers outlive the call.
    let code = unsafe { proxy_get_buffer_bytes(kind as u32, start, max, &mut data, &mut size) };
    found(code, data, size)
}

/// A header's value as the bytes Envoy holds; an empty value is `Some(vec![])`.
pub fn header(map: MapType, name: &str) -> Result<Option<Vec<u8>>, Status> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: the key is valid for its length; out-pointers outlive the call.
    let code = unsafe {
        proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut data, &mut size)
    };
    let is_ok = code == OK;
    found(code, data, size).map(|v| {
        if is_ok {
            Some(v.unwrap_or_default())
        } else {
            v
        }
    })
}

/// Every header of a map, in order, values as bytes: one host call (and one copy into the
/// VM) instead of one per header looked at.
pub fn headers(map: MapType) -> Result<Vec<(String, Vec<u8>)>, Status> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: out-pointers outlive the call.
    let code = unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) };
    match found(code, data, size)? {
        Some(b) => parse_pairs(&b).ok_or(Status::SerializationFailure),
        None => Ok(Vec::new()),
    }
}

/// The ABI's map encoding (see `serialize_pairs`) back into pairs; `None` if it is cut short.
fn parse_pairs(b: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let word = |at: usize| -> Option<usize> {
        let w: [u8; 4] = b.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(w)).ok()
    };
    let n = word(0)?;
    let mut sizes = 4usize;
    let mut data = n.checked_mul(8)?.checked_add(4)?;
    let mut out = Vec::with_capacity(n.min(b.len() / 8));
    for _ in 0..n {
        let (klen, vlen) = (word(sizes)?, word(sizes.checked_add(4)?)?);
        sizes = sizes.checked_add(8)?;
        let key = b.get(data..data.checked_add(klen)?)?;
        data = data.checked_add(klen)?.checked_add(1)?;
        let value = b.get(data..data.checked_add(vlen)?)?;
        data = data.checked_add(vlen)?.checked_add(1)?;
        out.push((String::from_utf8_lossy(key).into_owned(), value.to_vec()));
    }
    Some(out)
}

pub fn set_header(map: MapType, name: &str, value: Option<&str>) -> Result<(), Status> {
    // SAFETY: key and value are valid for their lengths; the host copies them.
    status(unsafe {
        match value {
            Some(v) => proxy_replace_header_map_value(
                map as u32,
                name.as_ptr(),
                name.len(),
                v.as_ptr(),
                v.len(),
            ),
            None => proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()),
        }
    })
}

/// Path segments joined by NUL, as `proxy_get_property` expects.
fn property_path(path: &[&str]) -> Vec<u8> {
    path.join("\0").into_bytes()
}

pub fn property(path: &[&str]) -> Result<Option<Vec<u8>>, Status> {
    let p = property_path(path);
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: the path is valid for its length; out-pointers outlive the call.
    let code = unsafe { proxy_get_property(p.as_ptr(), p.len(), &mut data, &mut size) };
    found(code, data, size)
}

/// Header pairs in the ABI's map encoding: a count, each pair's two lengths, then each
/// name and value followed by a NUL. Lengths beyond u32 cannot be sent and are refused.
fn serialize_pairs(pairs: &[(&str, &str)]) -> Option<Vec<u8>> {
    let len = |n: usize| u32::try_from(n).ok().map(u32::to_le_bytes);
    let mut out = Vec::new();
    out.extend_from_slice(&len(pairs.len())?);
    for (k, v) in pairs {
        out.extend_from_slice(&len(k.len())?);
        out.extend_from_slice(&len(v.len())?);
    }
    for (k, v) in pairs {
        for part in [k, v] {
            out.extend_from_slice(part.as_bytes());
            out.push(0);
        }
    }
    Some(out)
}

pub fn send_response(
    status_code: u32,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), Status> {
    let h = serialize_pairs(headers).ok_or(Status::BadArgument)?;
    // SAFETY: every pointer is valid for its length; the host copies the data.
    status(unsafe {
        proxy_send_local_response(
            status_code,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            h.as_ptr(),
            h.len(),
            -1,
        )
    })
}

pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, Status> {
    let mut id = 0u32;
    // SAFETY: the name is valid for its length; `id` outlives the call.
    status(unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_metric(id: u32, n: i64) -> Result<(), Status> {
    // SAFETY: no pointers.
    status(unsafe { proxy_increment_metric(id, n) })
}

pub fn record_metric(id: u32, v: u64) -> Result<(), Status> {
    // SAFETY: no pointers.
    status(unsafe { proxy_record_metric(id, v) })
}

/// A counter's or gauge's process-wide value (Envoy has none for histograms).
pub fn get_metric(id: u32) -> Result<u64, Status> {
    let mut v = 0u64;
    // SAFETY: the out-pointer outlives the call.
    status(unsafe { proxy_get_metric(id, &mut v) })?;
    Ok(v)
}

/// The value and its CAS token (0 means none).
pub fn get_shared(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Status> {
    let (mut data, mut size, mut cas) = (null_mut(), 0usize, 0u32);
    // SAFETY: the key is valid for its length; out-pointers outlive the call.
    let code =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    let v = found(code, data, size)?;
    Ok((v, (code == OK && cas != 0).then_some(cas)))
}

pub fn set_shared(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
    // SAFETY: key and value are valid for their lengths; the host copies them.
    status(unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
            cas.unwrap_or(0),
        )
    })
}

pub fn register_queue(name: &str) -> Result<u32, Status> {
    let mut id = 0u32;
    // SAFETY: the name is valid for its length; `id` outlives the call.
    status(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn resolve_queue(vm_id: &str, name: &str) -> Result<Option<u32>, Status> {
    let mut id = 0u32;
    // SAFETY: both strings are valid for their lengths; `id` outlives the call.
    let code = unsafe {
        proxy_resolve_shared_queue(
            vm_id.as_ptr(),
            vm_id.len(),
            name.as_ptr(),
            name.len(),
            &mut id,
        )
    };
    match status(code) {
        Ok(()) => Ok(Some(id)),
        Err(Status::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

pub fn dequeue(id: u32) -> Result<Option<Vec<u8>>, Status> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: out-pointers outlive the call.
    let code = unsafe { proxy_dequeue_shared_queue(id, &mut data, &mut size) };
    match status(code) {
        // SAFETY: the host filled `data`/`size` for this call.
        Ok(()) => Ok(unsafe { take(data, size) }),
        Err(Status::Empty) => Ok(None),
        Err(e) => Err(e),
    }
}

pub fn enqueue(id: u32, msg: &[u8]) -> Result<(), Status> {
    // SAFETY: the message is valid for its length; the host copies it.
    status(unsafe { proxy_enqueue_shared_queue(id, msg.as_ptr(), msg.len()) })
}

pub fn grpc_send(token: u32, msg: &[u8], end_stream: bool) -> Result<(), Status> {
    // SAFETY: the message is valid for its length; the host copies it.
    status(unsafe { proxy_grpc_send(token, msg.as_ptr(), msg.len(), u32::from(end_stream)) })
}

pub fn grpc_cancel(token: u32) -> Result<(), Status> {
    // SAFETY: plain value arguments.
    status(unsafe { proxy_grpc_cancel(token) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_pairs_encode_like_the_abi() {
        let b = serialize_pairs(&[("a", "xy"), ("", "z")]).unwrap();
        let mut want = Vec::new();
        for n in [2u32, 1, 2, 0, 1] {
            want.extend_from_slice(&n.to_le_bytes());
        }
        want.extend_from_slice(b"a\0xy\0\0z\0");
        assert_eq!(b, want);
        assert_eq!(
            parse_pairs(&b).unwrap(),
            vec![
                ("a".to_string(), b"xy".to_vec()),
                (String::new(), b"z".to_vec())
            ]
        );
        assert_eq!(parse_pairs(&[]), None);
        assert_eq!(parse_pairs(b.get(..b.len() - 2).unwrap()), None);
        assert_eq!(parse_pairs(&[0, 0, 0, 0]), Some(vec![]));
        let mut huge = b.clone();
        huge[0] = 0xff;
        assert_eq!(parse_pairs(&huge), None);
        assert_eq!(
            property_path(&["response", "code_details"]),
            b"response\0code_details"
        );
    }

    #[test]
    fn unknown_statuses_are_errors_not_panics() {
        assert_eq!(status(0), Ok(()));
        assert_eq!(status(8), Err(Status::CasMismatch));
        assert_eq!(status(6), Err(Status::InternalFailure));
        assert_eq!(status(u32::MAX), Err(Status::InternalFailure));
        assert_eq!(found(1, null_mut(), 0), Ok(None));
        assert_eq!(found(0, null_mut(), 0), Ok(None));
        assert_eq!(found(2, null_mut(), 0), Err(Status::BadArgument));
    }
}
