// The gateway the suite runs against (TENURE_URL, TENURE_TOKEN and a second
// identity's TENURE_TOKEN_OTHER), and a bounded poll. Without the variables
// the suite fails rather than skip.
import { Client } from "../src/index.js";

export function need(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set: run this suite through \`cargo nextest run -p tenure-cli --test clients\``);
  return value;
}

export const url = () => need("TENURE_URL");
export const client = () => new Client({ url: url(), token: need("TENURE_TOKEN") });
export const other = () => new Client({ url: url(), token: need("TENURE_TOKEN_OTHER") });

/** `check()`'s first value that is not null/undefined, polled for at most `boundMs`. */
export async function eventually(boundMs, check) {
  const deadline = Date.now() + boundMs;
  for (;;) {
    const value = await check();
    if (value !== null && value !== undefined) return value;
    if (Date.now() >= deadline) throw new Error(`no result within ${boundMs} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Runs `fn` and fails past `boundMs`. */
export async function within(boundMs, fn) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`not done within ${boundMs} ms`)), boundMs);
  });
  try {
    return await Promise.race([fn(), timeout]);
  } finally {
    clearTimeout(timer);
  }
}
