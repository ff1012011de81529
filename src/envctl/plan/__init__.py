"""Planning: a pure function from a spec plus host facts to an ordered list of resources."""
