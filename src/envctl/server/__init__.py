"""The resident root daemon (`envctl daemon`) and the CLI's client side of its socket."""
