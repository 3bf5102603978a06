"""The model and its math: the model API and example models (`models`; users import it as `hybridrec.models`),
bag pooling (`pooling`) and its compiled loops (`bag_kernels`), the tasks each output trains and answers
(`tasks`), eval metrics (`evaluation`), and a bundle's sharded table rows for a batch (`table_lookup`)."""
