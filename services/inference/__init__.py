"""The inference service: click probabilities of a trained model over the Open Inference Protocol."""
