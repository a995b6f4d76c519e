"""The compiler: the pipelines (convert, retarget, set_backward, load) as ordered lists of declared
passes run by one runner, and the conversion record they leave on the model."""
