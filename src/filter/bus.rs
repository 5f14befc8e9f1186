//! `SharedBus` over proxy-wasm shared data and shared queues.

use super::ffi;
use crate::replication::SharedBus;

pub struct HostBus {
    /// The `vm_id` queues are registered under; needed to resolve other VMs' queues.
    pub vm_id: String,
}

impl SharedBus for HostBus {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        ffi::get_shared(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        matches!(ffi::set_shared(key, value, cas), Ok(()))
    }

    fn register_queue(&self, name: &str) -> Option<u32> {
        ffi::register_queue(name).ok()
    }

    fn resolve_queue(&self, name: &str) -> Option<u32> {
        ffi::resolve_queue(&self.vm_id, name).ok().flatten()
    }

    fn enqueue(&self, queue: u32, msg: &[u8]) -> bool {
        ffi::enqueue(queue, msg).is_ok()
    }

    fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
        ffi::dequeue(queue).ok().flatten()
    }
}
