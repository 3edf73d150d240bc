"""What a token store directory holds: the names and version that planning, building and reading
agree on.

Layout of a store directory::

    manifest.json                 written last: its presence means the store is complete
    shards/train-00000.bin        the train tokens of input piece 0 (uint16, or uint32 for a
    shards/validation-00000.bin   vocabulary over 65536), documents separated by EOS
    shards/00000.json             what piece 0 read, wrote and skipped
    .lock                         held by the one process that builds the store
"""

FORMAT = "moara-jax token store"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
