"""A trained model taken out of a job: a finished run's checkpoint written as a bundle for serving (export), and
a bundle scoring data files offline with the serving code (predict)."""
