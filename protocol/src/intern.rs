//! Shared copies of the strings that repeat across many ids: kinds, worker
//! ids and owner sessions.
//!
//! A coordinator holding 100 000 tasks holds 100 000 copies of `noop` and of
//! its one client's session — in each record, each index key and each
//! `TaskId` clone — unless equal strings share one allocation. An [`Interner`]
//! hands out one `Arc<str>` per distinct value, so a clone is a reference
//! count, not an allocation.
//!
//! The table never pins what nobody uses: when it has grown to twice its size
//! after the last sweep, values held only by the table are dropped. So it
//! stays within twice the distinct values alive in the process, whatever
//! names a hostile client sends. It never changes what a value compares,
//! hashes or prints as: interning is a memory matter only.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};

/// Below this many entries the table is never swept.
const MIN_SWEEP_AT: usize = 64;

/// One vocabulary of interned strings (a `static`, one per id type).
pub(crate) struct Interner {
    table: Mutex<Table>,
}

struct Table {
    // A BTreeSet, not a HashSet: no random hash keys in the pure core.
    values: BTreeSet<Arc<str>>,
    sweep_at: usize,
}

impl Interner {
    pub(crate) const fn new() -> Interner {
        Interner { table: Mutex::new(Table { values: BTreeSet::new(), sweep_at: MIN_SWEEP_AT }) }
    }

    /// The shared copy of `s`, made now if there is none.
    pub(crate) fn intern(&self, s: &str) -> Arc<str> {
        // A panic elsewhere while holding the lock leaves the set intact.
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(shared) = table.values.get(s) {
            return shared.clone();
        }
        if table.values.len() >= table.sweep_at {
            // Held only by the table: nobody can reach it but through here.
            table.values.retain(|v| Arc::strong_count(v) > 1);
            table.sweep_at = (table.values.len() * 2).max(MIN_SWEEP_AT);
        }
        let shared: Arc<str> = Arc::from(s);
        table.values.insert(shared.clone());
        shared
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).values.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_share_one_allocation() {
        let interner = Interner::new();
        let a = interner.intern("noop");
        let b = interner.intern(&String::from("noop"));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &interner.intern("sleep")));
        assert_eq!(&*a, "noop");
    }

    #[test]
    fn values_nobody_holds_are_swept_and_the_table_stays_bounded() {
        let interner = Interner::new();
        let kept = interner.intern("kept");
        for i in 0..10_000 {
            drop(interner.intern(&format!("gone-{i}")));
        }
        assert!(interner.len() <= MIN_SWEEP_AT, "table grew to {}", interner.len());
        // A value still held elsewhere survives every sweep.
        assert!(Arc::ptr_eq(&kept, &interner.intern("kept")));
        let held: Vec<Arc<str>> = (0..1000).map(|i| interner.intern(&format!("held-{i}"))).collect();
        assert!(interner.len() <= 2 * (held.len() + 1) + MIN_SWEEP_AT);
        assert!(held.iter().enumerate().all(|(i, h)| Arc::ptr_eq(h, &interner.intern(&format!("held-{i}")))));
    }
}
