package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;

import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.List;
import org.junit.jupiter.api.Test;

/** The segmenter in rounds, as {@link HybridRayDirectWriter} drives it. */
class PartitionSegmenterTest {
  private static final String KEY = "spark-app-1-7";

  private static byte[] bytes(String s) {
    return s.getBytes(StandardCharsets.UTF_8);
  }

  private static String payload(PartitionSegmenter.Segment s, long mapId) throws Exception {
    int n = SegmentCodec.verify(s.frame(),
        SegmentCodec.identity(KEY, mapId, s.partition(), s.index()), "seg");
    return new String(Arrays.copyOfRange(s.frame(), SegmentCodec.HEADER_BYTES,
        SegmentCodec.HEADER_BYTES + n), StandardCharsets.UTF_8);
  }

  @Test
  void roundsRestartAtPartitionZeroAndContinueEachPartitionsIndices() throws Exception {
    PartitionSegmenter seg = new PartitionSegmenter(KEY, 9L, 3, 4);
    seg.startRound();
    seg.write(0, bytes("abcdef"), 0, 6);   // one full segment and a partial one
    seg.finishPartition(0);
    seg.write(2, bytes("xy"), 0, 2);
    seg.startRound();                      // seals partition 2's partial segment
    List<PartitionSegmenter.Segment> first = seg.takePending();
    seg.write(0, bytes("gh"), 0, 2);
    seg.write(1, bytes("z"), 0, 1);
    seg.startRound();
    List<PartitionSegmenter.Segment> second = seg.takePending();

    assertEquals(List.of("0/0", "0/1", "2/0"), first.stream()
        .map(s -> s.partition() + "/" + s.index()).toList());
    assertEquals(List.of("0/2", "1/0"), second.stream()
        .map(s -> s.partition() + "/" + s.index()).toList());
    StringBuilder p0 = new StringBuilder();
    for (PartitionSegmenter.Segment s : first) {
      if (s.partition() == 0) {
        p0.append(payload(s, 9L));
      }
    }
    p0.append(payload(second.get(0), 9L));
    assertEquals("abcdefgh", p0.toString());           // a block's segments, in index order
    assertArrayEquals(new long[] {8, 1, 2}, seg.partitionLengths());
  }

  @Test
  void withinARoundPartitionsMustNotGoBack() {
    PartitionSegmenter seg = new PartitionSegmenter(KEY, 9L, 3, 4);
    seg.write(2, bytes("a"), 0, 1);
    assertThrows(IllegalStateException.class, () -> seg.write(1, bytes("b"), 0, 1));
  }

  @Test
  void piecesGrowTheFrameAcrossSegmentsAndEveryFrameIsExact() throws Exception {
    int segmentBytes = 3 * PartitionSegmenter.MIN_FRAME + 5;  // frames grow past MIN_FRAME
    byte[] data = new byte[2 * segmentBytes + 1234];
    for (int i = 0; i < data.length; i++) {
      data[i] = (byte) (i * 7 + i / 251);
    }
    PartitionSegmenter seg = new PartitionSegmenter(KEY, 3L, 2, segmentBytes);
    for (int off = 0; off < data.length; off += 1000) {
      seg.write(1, data, off, Math.min(1000, data.length - off));
    }
    seg.finishPartition(1);
    List<PartitionSegmenter.Segment> out = seg.takePending();
    assertEquals(3, out.size());
    java.io.ByteArrayOutputStream joined = new java.io.ByteArrayOutputStream();
    for (PartitionSegmenter.Segment s : out) {
      int n = SegmentCodec.verify(s.frame(),
          SegmentCodec.identity(KEY, 3L, s.partition(), s.index()), "seg");
      assertEquals(SegmentCodec.HEADER_BYTES + n, s.frame().length);
      joined.write(s.frame(), SegmentCodec.HEADER_BYTES, n);
    }
    assertEquals(segmentBytes, out.get(0).payloadBytes());
    assertArrayEquals(data, joined.toByteArray());
  }

  @Test
  void aPartitionWrittenInOneCallGetsAFrameOfItsSize() throws Exception {
    PartitionSegmenter seg = new PartitionSegmenter(KEY, 3L, 1, 4 << 20);
    seg.write(0, bytes("small"), 0, 5);
    seg.finishPartition(0);
    PartitionSegmenter.Segment s = seg.takePending().get(0);
    assertEquals(SegmentCodec.HEADER_BYTES + 5, s.frame().length);
    assertEquals("small", payload(s, 3L));
  }
}
