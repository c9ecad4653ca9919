"""The allocator transaction: ``allocate_slots`` rolled back on failure (record, journal, plan, undo), and the audit that proves nothing leaked."""
