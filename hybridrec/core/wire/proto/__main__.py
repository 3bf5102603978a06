from hybridrec.core.wire.proto import regenerate

regenerate()
