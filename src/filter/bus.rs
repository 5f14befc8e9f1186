//! `SharedBus` over proxy-wasm shared data and shared queues.

use crate::replication::SharedBus;
use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

pub struct HostBus {
    /// The `vm_id` queues are registered under; needed to resolve other VMs' queues.
    pub vm_id: String,
}

impl SharedBus for HostBus {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        matches!(hostcalls::set_shared_data(key, Some(value), cas), Ok(()))
    }

    fn register_queue(&self, name: &str) -> Option<u32> {
        hostcalls::register_shared_queue(name).ok()
    }

    fn resolve_queue(&self, name: &str) -> Option<u32> {
        hostcalls::resolve_shared_queue(&self.vm_id, name)
            .ok()
            .flatten()
    }

    fn enqueue(&self, queue: u32, msg: &[u8]) -> bool {
        !matches!(
            hostcalls::enqueue_shared_queue(queue, Some(msg)),
            Err(Status::NotFound) | Err(_)
        )
    }

    fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
        hostcalls::dequeue_shared_queue(queue).ok().flatten()
    }
}
