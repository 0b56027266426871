"""What the paged engine is measured against, plugged in from outside the core: the paper's
contiguous KV allocators (behind the block manager's interface) and the dense reference generate."""
