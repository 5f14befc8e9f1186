//! STUB (replaced by the index branch): block hash -> workers holding it.
pub type WorkerId = u16;
pub const MAX_WORKERS: usize = 256;
pub struct PrefixIndex { ttl_ms: u64 }
impl PrefixIndex {
    pub fn new(ttl_ms: u64) -> Self { Self { ttl_ms } }
    pub fn set_capacity(&mut self, _w: WorkerId, _blocks: u32) {}
    pub fn lookup(&self, _hashes: &[u64], _now_ms: u64, out: &mut [u32]) { out.fill(0); let _ = self.ttl_ms; }
    pub fn insert(&mut self, _w: WorkerId, _hashes: &[u64], _now_ms: u64) {}
    pub fn truncate(&mut self, _w: WorkerId, _hashes: &[u64], _keep: usize) {}
    pub fn clear_worker(&mut self, _w: WorkerId) {}
    pub fn expire(&mut self, _now_ms: u64, _max_work: usize) -> usize { 0 }
    pub fn blocks(&self) -> usize { 0 }
    pub fn entries(&self, _w: WorkerId) -> usize { 0 }
    pub fn memory_bytes(&self) -> usize { 0 }
}
