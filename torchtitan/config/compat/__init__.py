"""torchtitan 2025's config read as ours: the key table (keys_2025), the spellings per source, what needs every source."""
