package org.apache.spark.shuffle.hybridray;

import java.io.IOException;
import java.util.List;

/** Where a map attempt's sealed segments go (hybrid_ray's tiers; a fake in unit tests). */
public interface SegmentSink {
  /**
   * Store {@code segments} and publish them for readers; {@code last} marks the map's
   * final batch (its output is complete). Throws if any segment could not be stored.
   */
  void store(List<PartitionSegmenter.Segment> segments, boolean last) throws IOException;

  /** The attempt failed: delete whatever it stored and give its space back. Never throws. */
  void abort(Throwable cause);
}
