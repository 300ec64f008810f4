// Loaded with `node --import` before Portkey's gateway 1.15.2: on Node its streamed answers
// fail ({"status":"failure"}, "TypeError: immutable") because it adds its x-portkey-* headers
// to the upstream's fetch Response, whose headers are immutable (Portkey-AI/gateway#1550,
// #1389). Here such a header change is skipped instead: the answer relays as it came.
const guarded = (name) => {
  const original = Headers.prototype[name];
  Headers.prototype[name] = function (...args) {
    try {
      return original.apply(this, args);
    } catch (error) {
      if (error instanceof TypeError && error.message === "immutable") return undefined;
      throw error;
    }
  };
};
for (const name of ["append", "set", "delete"]) guarded(name);
