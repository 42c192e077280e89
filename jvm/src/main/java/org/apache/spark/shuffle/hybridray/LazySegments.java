package org.apache.spark.shuffle.hybridray;

import java.io.InputStream;
import java.util.Enumeration;
import java.util.NoSuchElementException;
import java.util.function.IntFunction;

/**
 * The segments of one block as streams for a {@link java.io.SequenceInputStream}, each
 * opened (fetched and verified) only when the reader reaches it. A block's bytes were all
 * fetched before its first record was read, so a skewed block (one map's gigabytes for
 * one reducer) had to fit in the executor's heap; now about one segment of it does.
 */
final class LazySegments implements Enumeration<InputStream> {
  private final int count;
  private final IntFunction<InputStream> open;
  private int next;

  /** Segments {@code 0..count-1}, segment i opened by {@code open.apply(i)} when reached. */
  LazySegments(int count, IntFunction<InputStream> open) {
    this.count = count;
    this.open = open;
  }

  @Override
  public boolean hasMoreElements() {
    return next < count;
  }

  @Override
  public InputStream nextElement() {
    if (next >= count) {
      throw new NoSuchElementException();
    }
    return open.apply(next++);
  }
}
