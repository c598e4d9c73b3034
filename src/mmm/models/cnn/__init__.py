"""mmm's small convolutional classifier for handwritten digits (:mod:`.model`, plain single-device
code) and its recipe beside it (:mod:`.recipe`)."""

from mmm.models.cnn.model import DigitsCNN, log_softmax_nll

__all__ = ["DigitsCNN", "log_softmax_nll"]
