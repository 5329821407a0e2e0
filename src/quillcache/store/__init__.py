"""The byte pool of one node: the DRAM arena, the SSD tier, their tiering (``tiers.LocalKvStore``
and its parts) and the identity guard."""
