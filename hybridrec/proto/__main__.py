from hybridrec.proto import regenerate

regenerate()
